#pragma once
// Internal: whether the current backward runs a node with nothing reading its input gradient on
// the way: no pre-hook on it (a tensor hook, retain_grad), and no capture of it (autograd.grad(...,
// inputs)). Only then may a gradient bound for it arrive later than autograd would hand it over.

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>

namespace hyper_parallel::detail {

inline bool runs_unobserved(const torch::autograd::Node& node) {
  if (!node.pre_hooks().empty()) return false;
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info == nullptr || exec_info->empty()) return true;  // a plain backward runs every node
  auto it = exec_info->find(const_cast<torch::autograd::Node*>(&node));
  return it != exec_info->end() && it->second.needed_ && !it->second.captures_;
}

}  // namespace hyper_parallel::detail
