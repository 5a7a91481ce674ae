#include <hyper_parallel/core/comm/row_sparse_all_reduce.h>

#include <algorithm>
#include <numeric>
#include <sstream>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/p2p.h>

#include "pending_all_reduce_state.h"

namespace hyper_parallel::comm {

namespace {

// Tags of the steps: the row counts, then either the dense phases or the rows' indices and values.
constexpr int64_t kCountStep = 0, kDenseReduceStep = 1, kDenseGatherStep = 2, kIndexStep = 3, kRowStep = 4;

// The rows with any bit set: a row of -0.0 counts, since the dense sum's bits depend on it. Read
// as the widest integers that tile a row (an embedding's bf16 row as int64 words: 4x fewer
// compares than as int16).
at::Tensor rows_with_bits(const at::Tensor& matrix) {
  const int64_t row_bytes = matrix.size(1) * matrix.element_size();
  if (row_bytes == 0) return at::empty({0}, at::kLong);  // rows of no elements have no bits
  // The word must tile the rows and the buffer's offset in its storage alike.
  const int64_t tiled = std::gcd(row_bytes, matrix.storage_offset() * matrix.element_size());
  const auto word = tiled % 8 == 0 ? at::kLong : tiled % 4 == 0 ? at::kInt : at::kShort;
  return matrix.view(word).ne(0).any(1).nonzero().view({-1});
}

// Every rank's row count (exchanged directly: a count from and to each peer).
std::vector<int64_t> exchange_counts(detail::PendingAllReduceState& s, int64_t own) {
  const int64_t p = s.group.size(), r = s.group.rank();
  auto counts = at::zeros({p}, at::kLong);
  counts[r] = own;
  for (int64_t q = 0; q < p; ++q) {
    if (q == r) continue;
    s.receives.push_back(irecv(counts.narrow(0, q, 1), q, s.group, s.tags.step(kCountStep)));
    s.sends.push_back(isend(counts.narrow(0, r, 1), q, s.group, s.tags.step(kCountStep)));
  }
  s.wait_all();
  return std::vector<int64_t>(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + p);
}

// The union of the ranks' rows (`any_rank`, ascending), summed a slice of its rows at a time:
// each rank's rows in the slice, padded with zeros where it had none, are the dense sum's
// operands. P slices of about kSliceElements each, not P copies of the union (for a 1 GB
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
    detail::sum_in_rank_order(slices, out, op);
    matrix.index_copy_(0, any_rank.narrow(0, first, len), out);
  }
}

// Row-sparse: each rank sends its rows (indices, then values with the dense tail appended) to
// every other rank. Then every rank sums, in rank order, the rows any rank sent, with zeros where
// a rank had none: the dense sum's operands, so its bits. Rows no rank sent are zero everywhere,
// and zero in the buffer already.
void exchange_rows(detail::PendingAllReduceState& s, const at::Tensor& matrix, const at::Tensor& tail,
                   const at::Tensor& own_rows, const std::vector<int64_t>& counts) {
  const int64_t p = s.group.size(), r = s.group.rank(), cols = matrix.size(1), t = tail.numel();
  std::vector<at::Tensor> indices(p), values(p);
  indices[r] = own_rows;
  values[r] = at::empty({counts[r] * cols + t}, matrix.options());  // rows gathered in place, no cat
  auto own_values = values[r].narrow(0, 0, counts[r] * cols).view({counts[r], cols});
  at::index_select_out(own_values, matrix, 0, own_rows);
  values[r].narrow(0, counts[r] * cols, t).copy_(tail);
  for (int64_t q = 0; q < p; ++q) {
    if (q == r) continue;
    indices[q] = at::empty({counts[q]}, at::kLong);
    values[q] = at::empty({counts[q] * cols + t}, matrix.options());
    s.receives.push_back(irecv(indices[q], q, s.group, s.tags.step(kIndexStep)));
    s.receives.push_back(irecv(values[q], q, s.group, s.tags.step(kRowStep)));
  }
  for (int64_t k = 1; k < p; ++k) {
    const int64_t q = (r + k) % p;
    s.sends.push_back(isend(indices[r], q, s.group, s.tags.step(kIndexStep)));
    s.sends.push_back(isend(values[r], q, s.group, s.tags.step(kRowStep)));
  }
  s.wait_all();
  const auto any_rank = std::get<0>(at::_unique(at::cat(indices), /*sorted=*/true));
  std::vector<at::Tensor> positions(p), rows(p), tails(p);
  for (int64_t q = 0; q < p; ++q) {
    positions[q] = at::searchsorted(any_rank, indices[q]);
    rows[q] = values[q].narrow(0, 0, counts[q] * cols).view({counts[q], cols});
    tails[q] = values[q].narrow(0, counts[q] * cols, t);
  }
  sum_union_in_row_slices(matrix, any_rank, positions, rows, s.op);
  detail::sum_in_rank_order(tails, tail, s.op);
}

void reduce(detail::PendingAllReduceState& s, int64_t rows, int64_t cols) {
  const int64_t p = s.group.size();
  auto matrix = s.buffer.narrow(0, 0, rows * cols).view({rows, cols});
  auto tail = s.buffer.narrow(0, rows * cols, s.buffer.numel() - rows * cols);
  const auto own_rows = rows_with_bits(matrix);
  const auto counts = exchange_counts(s, own_rows.size(0));
  // The bytes the busiest rank sends: its rows and their indices to each of the P - 1 peers,
  // against a dense all-reduce's 2 (P - 1) / P of the buffer. Every rank decides alike, from the
  // same counts.
  const int64_t row_bytes = cols * s.buffer.element_size() + static_cast<int64_t>(sizeof(int64_t));
  const int64_t most = *std::max_element(counts.begin(), counts.end());
  if (most * row_bytes * p >= 2 * static_cast<int64_t>(s.buffer.nbytes())) {
    s.post_reduce(kDenseReduceStep);
    s.gather(kDenseGatherStep);
    return;
  }
  exchange_rows(s, matrix, tail, own_rows, counts);
}

}  // namespace

PendingAllReduce start_row_sparse_all_reduce(const at::Tensor& buffer, int64_t rows, int64_t cols,
                                             ReduceOp op, const Group& group, Agreement agreement) {
  TORCH_CHECK_TYPE(
      buffer.defined() && at::isFloatingType(buffer.scalar_type()),
      "hyper_parallel::comm::start_row_sparse_all_reduce: expected a floating-point tensor, got ",
      buffer.defined() ? c10::toString(buffer.scalar_type()) : "an undefined tensor");
  TORCH_CHECK_VALUE(
      buffer.is_contiguous() && buffer.dim() == 1,
      "hyper_parallel::comm::start_row_sparse_all_reduce: expected a contiguous 1-D buffer, got "
      "sizes ",
      buffer.sizes(), " and strides ", buffer.strides());
  TORCH_CHECK_VALUE(rows >= 0 && cols >= 0 && (cols == 0 || rows <= buffer.numel() / cols),
                    "hyper_parallel::comm::start_row_sparse_all_reduce: expected rows x cols within the ",
                    buffer.numel(), " elements of the buffer, got ", rows, " x ", cols);
  std::ostringstream what;
  what << buffer.scalar_type() << "[" << rows << ", " << cols << "] + " << buffer.numel() - rows * cols
       << " dense, row-sparse, on " << group.name() << " (started)";
  OpScope scope(group,
                {CollectiveKind::kAllReduce,
                 buffer.scalar_type(),
                 {buffer.numel(), static_cast<int64_t>(op == ReduceOp::kAvg), rows, cols + 1},
                 {"numel", "avg", "rows", "row_sparse_cols+1"}},  // never a dense all-reduce's signature
                what.str(), /*counted=*/true, agreement);
  auto state = std::make_shared<detail::PendingAllReduceState>(buffer.detach(), op, group);
  if (group.size() == 1) {
    state->done = true;
    return PendingAllReduce(std::move(state));
  }
  detail::complete_on_completion_thread(
      state, scope, [rows, cols](detail::PendingAllReduceState& s) { reduce(s, rows, cols); });
  return PendingAllReduce(std::move(state));
}

}  // namespace hyper_parallel::comm
