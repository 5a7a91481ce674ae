#pragma once
// Internal: what one backward pass tells about a GradientReducer's parameters (the order and the
// times their gradients became ready), and the bucket layout rank 0's record gives every rank:
// DDP's bucket rebuild, with the last buckets shrunk by the time the backward has left.

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/process_group.h>

#include "bucket_layout.h"

namespace hyper_parallel::data_parallel::detail {

class BackwardOrder {
 public:
  /// A pass starts: what an earlier (failed) pass recorded is dropped.
  void begin_pass();
  /// Parameter `param`'s gradient is ready now.
  void record(int64_t param);
  /// The pass's backward has ended (the autograd engine's final callback).
  void end_pass();
  /// The pass failed: its record does not lay out buckets.
  void fail_pass();

  /// The layout of rank 0's record: `params` in the order its pass made them ready (those it did
  /// not reach last, ready at its end), the last buckets shrunk by the time left after each
  /// gradient where `caps.shrink_last`. nullopt where rank 0's pass failed, on every rank alike.
  /// Collective (one broadcast): every rank of `group` calls it at the end of the same pass.
  std::optional<std::vector<BucketSpan>> agreed_layout(const std::vector<at::Tensor>& params,
                                                       const BucketCaps& caps, const comm::Group& group);

 private:
  int64_t microseconds_since_start() const;

  std::vector<int64_t> order_, ready_us_;  // parameters, and when (microseconds after the start)
  std::chrono::steady_clock::time_point start_;
  int64_t end_us_ = -1;  // when the backward ended; -1: not yet, or the pass failed
};

}  // namespace hyper_parallel::data_parallel::detail
