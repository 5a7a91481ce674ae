#pragma once
// Internal: the fully_shard groups that hold gradient sums of backwards run without sync
// (gradient accumulation), or, under HSDP with all_reduce off, reduce-scattered sums that wait
// for the all-reduce, process-wide, in the order the groups were made (the same on every
// rank, whichever order its unsynced backwards reached them in). A synced backward reduces a
// group's sums with its own gradients; one that does not reach the group at all reduces them at
// its end, so the optimizer step sees every micro-batch and no sum is carried into a later step.
// Backward's thread only. held_sums.cpp also holds ParamGroup::Impl's side of it (holds_sums,
// reduce_held_sums).

#include <memory>

#include <hyper_parallel/core/fully_shard/param_group.h>

namespace hyper_parallel::fully_shard::detail {

/// `group` holds sums from a backward without sync or without all-reduce (called at each such
/// backward; kept once).
void note_held_sums(const std::shared_ptr<ParamGroup::Impl>& group);

/// Called by a group this synced backward reaches: queues once per backward (autograd's final
/// callbacks) the reduction of the sums every noted group that the backward did not reach holds.
void queue_reduce_of_held_sums();

}  // namespace hyper_parallel::fully_shard::detail
