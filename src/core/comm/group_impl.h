#pragma once
// Internal: what a Group is made of. The only place (with process_group.cpp and p2p.cpp) that
// knows about c10d, so that a move to libtorch 2.x / NCCL touches core/comm alone.

#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/comm/work.h>

namespace hyper_parallel::comm::detail {

struct GroupImpl {
  c10::intrusive_ptr<c10d::ProcessGroup> backend;
  std::vector<int64_t> global_ranks;
  int64_t rank = 0;  // inside the group
  std::string name;
  std::chrono::milliseconds timeout{0};
  std::atomic<int64_t> next_op{0};   // tag blocks handed out so far
  std::atomic<int64_t> next_seq{0};  // ops (OpScope) started on this group so far
};

/// Posts a control message (an op's signature): a send or receive on the group's control tag,
/// matched in order per peer, neither counted as payload nor traced.
Work post_control(bool is_send, const at::Tensor& tensor, int64_t peer, const Group& group);

}  // namespace hyper_parallel::comm::detail
