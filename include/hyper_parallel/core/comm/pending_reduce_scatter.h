#pragma once
// PendingReduceScatter: a reduce-scatter whose transfers progress while the calling thread
// computes (fully_shard starts one per module as soon as its gradients are complete, and the
// backward goes on).
//
// Algorithm: direct reduce-scatter, one round (P ranks, this rank r; the flat tensor is cut into
// P blocks of torch.chunk sizes, block b owned by rank b): every rank sends block b straight to
// rank b; the completion thread receives the P - 1 partials of block r and sums the P partials
// in rank order in the accumulate dtype (schedule.h), scales for avg and rounds once. Each rank
// sends (P - 1) / P of the tensor: the bytes of a ring reduce-scatter, in one round. The sum
// order is fixed: the result is deterministic, and the same bits as PendingAllReduce's block r.
//
// Contract: as every collective (process_group.h); all ranks start the same reduce-scatters in
// the same order, with the same numel and dtype.

#include <memory>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/op.h>
#include <hyper_parallel/core/comm/process_group.h>

namespace hyper_parallel::comm {

namespace detail {
struct PendingAllReduceState;
}  // namespace detail

/// Usage:
///   auto pending = start_reduce_scatter(flat, ReduceOp::kAvg, group);
///   ... compute while it travels ...
///   at::Tensor mine = pending.wait();  // block r of flat, reduced over every rank
class PendingReduceScatter {
 public:
  PendingReduceScatter() = default;
  explicit PendingReduceScatter(std::shared_ptr<detail::PendingAllReduceState> state);

  /// Never blocks: whether the reduce-scatter has completed (then wait() returns at once).
  bool is_completed() const;
  /// Blocks until it completes and returns this rank's reduced block (a view of the buffer);
  /// throws a c10::Error if a transfer failed. Calling it again returns the same block.
  at::Tensor wait();

 private:
  std::shared_ptr<detail::PendingAllReduceState> state_;
  at::Tensor result_;
};

/// Starts reducing `buffer` (contiguous; float32, float64, bfloat16 or float16) over the group;
/// this rank's block (torch.chunk sizes of buffer.numel() over P) receives the result in place.
/// `buffer` must stay alive and untouched until wait() returns.
/// `agreement`: see op.h. `content`: OpSignature::content, what the buffer holds as the caller
/// names it (0: unnamed), so that ranks reducing different data of one size get an error.
PendingReduceScatter start_reduce_scatter(const at::Tensor& buffer, ReduceOp op, const Group& group,
                                          Agreement agreement = Agreement::kPerOp, int64_t content = 0);

}  // namespace hyper_parallel::comm
