#include "row_sparse_rows.h"

#include <algorithm>
#include <numeric>

#include <ATen/ATen.h>

#include "pending_all_reduce_state.h"

namespace hyper_parallel::comm::detail {

// Read as the widest integers that tile a row (an embedding's bf16 row as int64 words: 4x fewer
// compares than as int16).
at::Tensor rows_with_bits(const at::Tensor& matrix) {
  const int64_t row_bytes = matrix.size(1) * matrix.element_size();
  if (row_bytes == 0) return at::empty({0}, at::kLong);  // rows of no elements have no bits
  // The word must tile the rows and the buffer's offset in its storage alike.
  const int64_t tiled = std::gcd(row_bytes, matrix.storage_offset() * matrix.element_size());
  const auto word = tiled % 8 == 0 ? at::kLong : tiled % 4 == 0 ? at::kInt : at::kShort;
  return matrix.view(word).ne(0).any(1).nonzero().view({-1});
}

// P slices of about kSliceElements each, not P copies of the union (for a 1 GB
// embedding at P = 8, that would be up to 8 GB).
void sum_union_in_row_slices(const at::Tensor& matrix, const at::Tensor& any_rank,
                             const std::vector<at::Tensor>& positions, const std::vector<at::Tensor>& rows,
                             ReduceOp op) {
  constexpr int64_t kSliceElements = int64_t{1} << 17;
  const int64_t p = static_cast<int64_t>(rows.size()), u = any_rank.size(0), cols = matrix.size(1);
  if (u == 0) return;
  const int64_t slice_rows = std::min(u, std::max<int64_t>(1, kSliceElements / std::max<int64_t>(cols, 1)));
  std::vector<at::Tensor> padded(p), slices(p);
  for (auto& t : padded) t = at::empty({slice_rows, cols}, matrix.options());
  auto summed = at::empty({slice_rows, cols}, matrix.options());
  std::vector<int64_t> next(p, 0);  // per rank, its first row not summed yet
  for (int64_t first = 0; first < u; first += slice_rows) {
    const int64_t len = std::min(slice_rows, u - first);
    for (int64_t q = 0; q < p; ++q) {
      // A rank's positions ascend (rows_with_bits's do), so its rows in the slice are a run.
      const int64_t* pos = positions[q].data_ptr<int64_t>();
      int64_t end = next[q];
      while (end < positions[q].size(0) && pos[end] < first + len) ++end;
      slices[q] = padded[q].narrow(0, 0, len).zero_();
      slices[q].index_copy_(0, positions[q].narrow(0, next[q], end - next[q]) - first,
                            rows[q].narrow(0, next[q], end - next[q]));
      next[q] = end;
    }
    auto out = summed.narrow(0, 0, len);
    sum_in_rank_order(slices, out, op);
    matrix.index_copy_(0, any_rank.narrow(0, first, len), out);
  }
}

}  // namespace hyper_parallel::comm::detail
