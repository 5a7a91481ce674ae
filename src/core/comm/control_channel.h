#pragma once
// Internal: the control channel of a group, on which ops exchange their signatures before any
// payload moves (op.h). One tag per group, below the operations' tag blocks, matched in order
// per peer; neither counted as payload nor traced.

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/comm/work.h>

namespace hyper_parallel::comm::detail {

/// Posts a control message: a send or receive of `tensor` with group rank `peer`.
Work post_control(bool is_send, const at::Tensor& tensor, int64_t peer, const Group& group);

}  // namespace hyper_parallel::comm::detail
