#pragma once
// PendingAllReduce: an all-reduce whose transfers progress while the calling thread computes
// (a gradient reducer starts one per bucket during the backward and waits at its end).
//
// Algorithm: direct all-reduce, in two phases (P ranks, this rank r; the flat tensor is cut
// into P blocks of torch.chunk sizes, block b owned by rank b):
//   reduce  (posted by start_all_reduce) every rank sends block b, in place, straight to rank b
//           and receives the P - 1 partials of its own block;
//   gather  (run by the library's completion thread once those partials are here, so the
//           calling thread never stops for it) rank r sums the P partials of block r in rank
//           order in the accumulate dtype (schedule.h), scales for avg, rounds once, writes the
//           result over its own block and sends it to every other rank, receiving theirs into
//           the other blocks.
// Each rank sends (P - 1) / P of the tensor per phase, the bytes of a ring all-reduce, in 2
// rounds instead of 2 (P - 1). Every block is reduced by one rank in a fixed order: the result
// is deterministic and bitwise equal on every rank.
//
// Contract: as every collective (process_group.h); all ranks start the same all-reduces in the
// same order, with the same numel and dtype.

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
///   auto pending = start_all_reduce(bucket, ReduceOp::kAvg, group);
///   ... compute while it travels ...
///   pending.wait();  // bucket holds the average of every rank's bucket
class PendingAllReduce {
 public:
  PendingAllReduce() = default;  // already complete, reduces nothing
  explicit PendingAllReduce(std::shared_ptr<detail::PendingAllReduceState> state);

  /// Never blocks: whether the whole all-reduce has completed (then wait() returns at once).
  bool is_completed() const;
  /// Blocks until the all-reduce completes; throws a c10::Error if a transfer failed (peer gone,
  /// timeout). Calling it again is a no-op.
  void wait();

 private:
  std::shared_ptr<detail::PendingAllReduceState> state_;
};

/// Starts an in-place all-reduce of `buffer` (contiguous; float32, float64, bfloat16 or float16).
/// `buffer` must stay alive and untouched until wait() returns; it then holds the result.
/// `agreement`: see op.h; kAgreedInAdvance makes starting one never wait for a peer.
/// `content`: OpSignature::content, what the buffer holds as the caller names it (0: unnamed).
PendingAllReduce start_all_reduce(const at::Tensor& buffer, ReduceOp op, const Group& group,
                                  Agreement agreement = Agreement::kPerOp, int64_t content = 0);

}  // namespace hyper_parallel::comm
