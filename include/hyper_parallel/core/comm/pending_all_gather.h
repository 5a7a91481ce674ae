#pragma once
// PendingAllGather: an all-gather whose transfers progress while the calling thread computes
// (fully_shard starts the next module's parameter gather and computes this one's forward).
//
// Algorithm: direct all-gather, one round (P ranks, this rank r): rank r sends its block to
// every other rank and receives theirs into place; the completion thread waits for the
// transfers. Each rank sends (P - 1) times its block: the bytes of a ring all-gather, in one
// round instead of P - 1. The result is bitwise every rank's input, concatenated in rank order.
//
// Contract: as every collective (process_group.h); all ranks start the same all-gathers in the
// same order, with the same numel and dtype.

#include <memory>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/op.h>
#include <hyper_parallel/core/comm/process_group.h>

namespace hyper_parallel::comm {

namespace detail {
struct PendingAllReduceState;
}  // namespace detail

/// Usage:
///   auto pending = start_all_gather(flat_shard, group);
///   ... compute while it travels ...
///   at::Tensor all = pending.wait();  // [P * flat_shard.numel()], rank q's block at q * numel
class PendingAllGather {
 public:
  PendingAllGather() = default;
  explicit PendingAllGather(std::shared_ptr<detail::PendingAllReduceState> state);

  /// Never blocks: whether every transfer has completed (then wait() returns at once).
  bool is_completed() const;
  /// Blocks until the all-gather completes and returns the gathered 1-D tensor; throws a
  /// c10::Error if a transfer failed (peer gone, timeout). Calling it again returns the same
  /// tensor without waiting.
  at::Tensor wait();

 private:
  std::shared_ptr<detail::PendingAllReduceState> state_;
  at::Tensor result_;
};

/// Starts gathering every rank's `input` (any dtype; read once, here: it may change after this
/// returns). The result is a new 1-D tensor of P * input.numel() elements.
/// `agreement`: see op.h. `content`: OpSignature::content, what `input` holds as the caller names
/// it (0: unnamed), so that ranks gathering different data of one size get an error.
PendingAllGather start_all_gather(const at::Tensor& input, const Group& group,
                                  Agreement agreement = Agreement::kPerOp, int64_t content = 0);

}  // namespace hyper_parallel::comm
