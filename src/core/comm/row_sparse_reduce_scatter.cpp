#include <hyper_parallel/core/comm/row_sparse_reduce_scatter.h>

#include <algorithm>
#include <sstream>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/p2p.h>

#include "pending_all_reduce_state.h"
#include "row_sparse_rows.h"

namespace hyper_parallel::comm {

namespace {

// Tags of the steps: the counts, then either the dense phase or the rows' indices and values.
constexpr int64_t kCountStep = 0, kDenseReduceStep = 1, kIndexStep = 2, kRowStep = 3;

// counts[q][b]: rank q's rows with bits in block b. Each rank sends its P counts to every other.
std::vector<std::vector<int64_t>> exchange_counts(detail::PendingAllReduceState& s, const at::Tensor& own) {
  const int64_t p = s.group.size(), r = s.group.rank();
  auto all = at::zeros({p, p}, at::kLong);
  all[r].copy_(own);
  for (int64_t q = 0; q < p; ++q) {
    if (q == r) continue;
    s.receives.push_back(irecv(all[q], q, s.group, s.tags.step(kCountStep)));
    s.sends.push_back(isend(all[r], q, s.group, s.tags.step(kCountStep)));
  }
  s.wait_all();
  std::vector<std::vector<int64_t>> counts(p);
  for (int64_t q = 0; q < p; ++q)
    counts[q].assign(all[q].data_ptr<int64_t>(), all[q].data_ptr<int64_t>() + p);
  return counts;
}

// Whether the row-sparse exchange sends fewer bytes than the dense one, for its busiest rank.
bool sparse_is_smaller(const std::vector<std::vector<int64_t>>& counts, int64_t row_bytes,
                       int64_t buffer_bytes) {
  const int64_t p = static_cast<int64_t>(counts.size());
  int64_t most = 0;
  for (int64_t q = 0; q < p; ++q) {
    int64_t rows = 0;
    for (int64_t b = 0; b < p; ++b) rows += b == q ? 0 : counts[q][b];
    most = std::max(most, rows);
  }
  const int64_t index_bytes = static_cast<int64_t>(sizeof(int64_t));
  return most * (row_bytes + index_bytes) * p < buffer_bytes * (p - 1);
}

// Each rank sends each owner its rows of the owner's block (indices within the block, then
// values); the owner sums, in rank order, the rows any rank had there, zeros where a rank had none.
void exchange_rows(detail::PendingAllReduceState& s, const at::Tensor& matrix, const at::Tensor& own_rows,
                   const std::vector<std::vector<int64_t>>& counts) {
  const int64_t p = s.group.size(), r = s.group.rank(), cols = matrix.size(1);
  const int64_t block_rows = matrix.size(0) / p;
  // own_rows ascend, so each block's rows are a run of them.
  std::vector<at::Tensor> send_indices(p), send_values(p), indices(p), values(p);
  int64_t first = 0;
  for (int64_t b = 0; b < p; ++b) {
    const auto run = own_rows.narrow(0, first, counts[r][b]);
    first += counts[r][b];
    send_indices[b] = run - b * block_rows;
    send_values[b] = matrix.index_select(0, run);
  }
  indices[r] = send_indices[r];
  values[r] = send_values[r];
  for (int64_t q = 0; q < p; ++q) {
    if (q == r) continue;
    indices[q] = at::empty({counts[q][r]}, at::kLong);
    values[q] = at::empty({counts[q][r], cols}, matrix.options());
    s.receives.push_back(irecv(indices[q], q, s.group, s.tags.step(kIndexStep)));
    s.receives.push_back(irecv(values[q], q, s.group, s.tags.step(kRowStep)));
  }
  for (int64_t k = 1; k < p; ++k) {
    const int64_t owner = (r + k) % p;  // each rank starts with a different peer
    s.sends.push_back(isend(send_indices[owner], owner, s.group, s.tags.step(kIndexStep)));
    s.sends.push_back(isend(send_values[owner], owner, s.group, s.tags.step(kRowStep)));
  }
  s.wait_all();
  const auto any_rank = std::get<0>(at::_unique(at::cat(indices), /*sorted=*/true));
  std::vector<at::Tensor> positions(p);
  for (int64_t q = 0; q < p; ++q) positions[q] = at::searchsorted(any_rank, indices[q]);
  detail::sum_union_in_row_slices(matrix.narrow(0, r * block_rows, block_rows), any_rank, positions, values,
                                  s.op);
}

void reduce_scatter(detail::PendingAllReduceState& s, int64_t cols) {
  const int64_t p = s.group.size();
  auto matrix = s.buffer.view({-1, cols});
  const int64_t block_rows = matrix.size(0) / p;
  const auto own_rows = detail::rows_with_bits(matrix);
  // Per block, the count of own_rows in it: the block of a row is row / block_rows.
  auto own_counts = at::zeros({p}, at::kLong);
  if (own_rows.numel() > 0)
    own_counts.index_add_(0, own_rows.div(block_rows, "floor"), at::ones_like(own_rows));
  const auto counts = exchange_counts(s, own_counts);
  const int64_t row_bytes = cols * s.buffer.element_size();
  if (!sparse_is_smaller(counts, row_bytes, static_cast<int64_t>(s.buffer.nbytes()))) {
    s.post_reduce(kDenseReduceStep);
    s.wait_all();
    detail::sum_in_rank_order(s.partials, s.partials[s.group.rank()], s.op);
    s.partials.clear();
    return;
  }
  exchange_rows(s, matrix, own_rows, counts);
}

}  // namespace

PendingReduceScatter start_row_sparse_reduce_scatter(const at::Tensor& buffer, int64_t cols, ReduceOp op,
                                                     const Group& group, Agreement agreement,
                                                     int64_t content) {
  constexpr const char* kName = "hyper_parallel::comm::start_row_sparse_reduce_scatter";
  TORCH_CHECK_TYPE(buffer.defined() && at::isFloatingType(buffer.scalar_type()), kName,
                   ": expected a floating-point tensor, got ",
                   buffer.defined() ? c10::toString(buffer.scalar_type()) : "an undefined tensor");
  TORCH_CHECK_VALUE(buffer.is_contiguous() && buffer.dim() == 1, kName,
                    ": expected a contiguous 1-D buffer, got sizes ", buffer.sizes(), " and strides ",
                    buffer.strides());
  const int64_t p = group.size();
  TORCH_CHECK_VALUE(cols >= 1 && buffer.numel() % (p * cols) == 0, kName, ": expected cols >= 1 and ", p,
                    " blocks of whole rows (numel a multiple of ", p, " x cols), got numel ", buffer.numel(),
                    " and cols ", cols);
  std::ostringstream what;
  what << buffer.scalar_type() << "[" << buffer.numel() / std::max<int64_t>(cols, 1) << ", " << cols
       << "] row-sparse, on " << group.name() << " (started)";
  OpSignature signature{CollectiveKind::kReduceScatter,
                        buffer.scalar_type(),
                        {buffer.numel(), static_cast<int64_t>(op == ReduceOp::kAvg), cols},
                        {"numel", "avg", "row_sparse_cols"}};  // never a dense reduce-scatter's signature
  signature.content = content;
  OpScope scope(group, signature, what.str(), /*counted=*/true, agreement);
  auto state = std::make_shared<detail::PendingAllReduceState>(buffer.detach(), op, group);
  if (p == 1) {
    state->done = true;
    return PendingReduceScatter(std::move(state));
  }
  detail::complete_on_completion_thread(
      state, scope, [cols](detail::PendingAllReduceState& s) { reduce_scatter(s, cols); });
  return PendingReduceScatter(std::move(state));
}

}  // namespace hyper_parallel::comm
