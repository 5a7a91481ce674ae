#include <hyper_parallel/core/comm/row_sparse_all_reduce.h>

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

// Tags of the steps: the row counts, then either the dense phases or the rows' indices and values.
constexpr int64_t kCountStep = 0, kDenseReduceStep = 1, kDenseGatherStep = 2, kIndexStep = 3, kRowStep = 4;

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
  detail::sum_union_in_row_slices(matrix, any_rank, positions, rows, s.op);
  detail::sum_in_rank_order(tails, tail, s.op);
}

void reduce(detail::PendingAllReduceState& s, int64_t rows, int64_t cols) {
  const int64_t p = s.group.size();
  auto matrix = s.buffer.narrow(0, 0, rows * cols).view({rows, cols});
  auto tail = s.buffer.narrow(0, rows * cols, s.buffer.numel() - rows * cols);
  const auto own_rows = detail::rows_with_bits(matrix);
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
