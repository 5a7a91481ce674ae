#pragma once
// ReplicaSync: makes a module's replicas over a data-parallel group start from the same state,
// as DDP does when it wraps a module: every rank gets group rank 0's values of the given states
// (parameters, buffers). Replicas that start apart (each rank seeded differently) would
// otherwise train apart, silently: their averaged gradients are added to different weights.
//
// Algorithm: the states' bytes, in order, are packed into buckets of at most `bucket_cap_bytes`
// (a state larger than the cap is a bucket alone); each bucket is one broadcast from rank 0
// (comm::broadcast), and every other rank copies it into its states.
//
// Usage (DDP's broadcast_buffers: the buffers again before each training forward):
//   ReplicaSync(params_and_buffers, mesh["dp"])();  // once, at setup
//   ReplicaSync buffers(model->buffers(), mesh["dp"]);
//   buffers();                                       // before a forward that updates them
//
// Contract: collective. Every rank of the group constructs it with states of the same dtypes
// and shapes in the same order (checked at construction: a mismatch is an error on every rank,
// naming the first state that differs), and calls it the same number of times.

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/dtensor/device_mesh.h>

namespace hyper_parallel::data_parallel {

class ReplicaSync {
 public:
  /// `names[i]` names states[i] in errors (default: "state i"); `mesh` is 1-D (the dp dimension).
  ReplicaSync(std::vector<at::Tensor> states, const dtensor::DeviceMesh& mesh,
              std::vector<std::string> names = {}, int64_t bucket_cap_bytes = int64_t{256} << 20);

  /// Copies group rank 0's values into this rank's states (in place, outside autograd).
  void operator()() const;

  int64_t bucket_count() const { return static_cast<int64_t>(bucket_ends_.size()); }

 private:
  std::vector<at::Tensor> states_;
  std::vector<size_t> bucket_ends_;  // bucket b holds states [bucket_ends_[b-1], bucket_ends_[b])
  comm::Group group_;
};

}  // namespace hyper_parallel::data_parallel
