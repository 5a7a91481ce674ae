#pragma once
// Internal: fully_shard's reduce-scatters in flight. A group's backward starts one (or one per
// bucket) and goes on; its parameters' deferred gradients (nn/pending_gradient.h) wait for it.
// The reductions of at most kMaxReducesInFlight groups travel at once, process-wide: each holds
// its flat gradients and the partials it receives.

#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/pending_reduce_scatter.h>
#include <hyper_parallel/core/comm/process_group.h>

namespace hyper_parallel::fully_shard::detail {

/// Sums a reduction took from where its group held them (kept while sync was off, or reduce-scattered
/// while the all-reduce was off), put back if a failed backward drops the reduction.
struct TakenSums {
  size_t param = 0;
  at::Tensor pending, partial;
  bool partial_reached = false;
};

/// A group's reduce-scatter in flight, then the sums held from earlier reduce-scatters (HSDP with
/// all_reduce off), its all-reduce over the replicate dim (HSDP) and its scaling: done once, by
/// the first of its parameters' deferred gradients to be finished.
struct ReduceInFlight {
  comm::PendingReduceScatter pending;
  at::Tensor unreduced;  // a shard dim of one rank: its flat gradients, reduced as they are
  std::optional<comm::Group> replicate;
  at::Tensor partial;  // reduce-scattered sums held from earlier backwards, added before the all-reduce
  // HSDP with all_reduce off: no all-reduce and no scaling; the result is held as partial sums.
  bool held = false;
  std::vector<TakenSums> taken;
  int64_t content = 0;  // the reduce-scatter's, for the all-reduce (comm::OpSignature::content)
  comm::ReduceOp op = comm::ReduceOp::kAvg;  // over the shard dim, then the replicate dim
  double scale = 1.0;
  // The last `flags` elements of every rank's block: per parameter, 1 where this rank has a
  // gradient for it, 0 where it has none; reduced, whether any rank has one.
  int64_t flags = 0;
  std::vector<bool> reached_anywhere;  // per parameter of the reduction, once waited for
  at::Tensor result;

  /// This rank's reduced flat gradients (waits for them the first time). The replicate
  /// all-reduce blocks, and ranks may wait in different orders (a hooked parameter's bucket is
  /// waited for mid-backward on a rank whose backward reaches it): the reductions started before
  /// this one are finished first, so every rank all-reduces in the order they started.
  const at::Tensor& wait();
};

constexpr size_t kMaxReducesInFlight = 2;

/// Before `group` starts a reduce-scatter: unless one of its own is in flight, finishes the oldest
/// ones in flight until fewer than kMaxReducesInFlight groups have any. The backward's thread
/// only.
void bound_reduces_in_flight(const void* group);
/// Counts `reduce`, started by `group`, among those in flight.
void track_reduce_in_flight(const void* group, const std::shared_ptr<ReduceInFlight>& reduce);

}  // namespace hyper_parallel::fully_shard::detail
