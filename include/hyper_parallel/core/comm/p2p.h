#pragma once
// Point-to-point transfers: the building block of every collective in this library.
// Transfers progress in the transport's own threads, so the calling thread can compute while
// they are in flight (this is what the ring collectives and MC2 rely on).

#include <cstdint>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/comm/work.h>

namespace hyper_parallel::comm {

/// Tags of one multi-step operation. Every operation reserves a fresh block so transfers of
/// concurrent or consecutive operations can never be matched with each other.
/// All ranks reserve blocks in the same order (the collective-order contract), so the blocks
/// agree across ranks.
class OpTags {
 public:
  static constexpr int64_t kMaxSteps = 1024;
  explicit OpTags(int64_t base) : base_(base) {}
  /// Tag of step `step` (0 <= step < kMaxSteps).
  int step(int64_t step) const;

 private:
  int64_t base_;
};

/// Reserves a tag block on `group` for one operation.
OpTags reserve_tags(const Group& group);

/// Sends `tensor` (contiguous) to group rank `dst`. Any dtype; 2-byte floats travel bit-exact.
/// The tensor must stay alive and unchanged until the Work completes.
Work isend(const at::Tensor& tensor, int64_t dst, const Group& group, int tag);
/// Receives into `tensor` (contiguous, with the sender's byte size) from group rank `src`.
Work irecv(const at::Tensor& tensor, int64_t src, const Group& group, int tag);

/// User-level tags must be in [0, kMaxUserTag); larger ones are reserved for this library.
constexpr int kMaxUserTag = 1 << 20;

}  // namespace hyper_parallel::comm
