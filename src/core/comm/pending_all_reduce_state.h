#pragma once
// Internal: the state a started collective (PendingAllReduce, PendingAllGather,
// PendingReduceScatter) shares with the completion thread, and the steps of the direct two-phase
// all-reduce (pending_all_reduce.h) that the dense and the row-sparse all-reduces use; the
// reduce-scatter is its first phase, the all-gather its second.

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <vector>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/op.h>
#include <hyper_parallel/core/comm/p2p.h>
#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/comm/work.h>

namespace hyper_parallel::comm::detail {

struct PendingAllReduceState {
  PendingAllReduceState(at::Tensor b, ReduceOp o, Group g)
      : buffer(std::move(b)), op(o), group(std::move(g)), tags(reserve_tags(group)) {}

  /// Block b of the flat buffer (torch.chunk sizes over the group), owned by rank b.
  at::Tensor block(int64_t b) const;
  /// Phase 1: block b to its owner b; the other ranks' partials of this rank's block arrive
  /// (tag of step `step`).
  void post_reduce(int64_t step);
  /// Phase 2, once phase 1's partials are here: this rank's block, summed in rank order, to
  /// every other rank; theirs into place (tag of step `step`). Waits for its transfers.
  void gather(int64_t step);
  void wait_all();
  void complete(std::exception_ptr failure);

  at::Tensor buffer;
  ReduceOp op;
  Group group;
  OpTags tags;
  std::vector<at::Tensor> partials;
  std::vector<Work> receives, sends;
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
};

/// `out` = the sum of `partials` (one per rank, in rank order) in the accumulate dtype, divided
/// by their count for kAvg, rounded once into out's dtype: the same operations per element
/// whatever the slicing, so the same bits.
void sum_in_rank_order(const std::vector<at::Tensor>& partials, const at::Tensor& out, ReduceOp op);

/// Runs `work` on `state`'s group's completion thread with the calling thread's settings
/// (skipped transfers, counters' region, the op's flight record, the trace op), then completes
/// the state with its failure, if any.
void complete_on_completion_thread(const std::shared_ptr<PendingAllReduceState>& state, OpScope& scope,
                                   std::function<void(PendingAllReduceState&)> work);

/// Starts the direct reduction of `buffer` over `group`, in place, as one op of `kind`: checks it
/// (a contiguous floating-point buffer, a group of at most OpTags::kMaxSteps ranks; messages
/// name `name`), agrees (`agreement`; `content`: OpSignature::content), posts phase 1 and runs
/// `finish` on the completion thread. A group of one rank is done at once: the sum and the
/// average of one rank's tensor are itself.
std::shared_ptr<PendingAllReduceState> start_reduction(const at::Tensor& buffer, ReduceOp op,
                                                       const Group& group, Agreement agreement,
                                                       int64_t content, CollectiveKind kind, const char* name,
                                                       std::function<void(PendingAllReduceState&)> finish);

/// Blocks until `state` completes, records the time blocked as an exposed wait in `op` (e.g.
/// "pending all_reduce") and rethrows its failure, if any.
void wait_until_complete(PendingAllReduceState& state, const char* op);

}  // namespace hyper_parallel::comm::detail
