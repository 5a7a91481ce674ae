// A fully_shard group's parameters that a backward does not reach: a conditional layer, an expert
// no token chose, the part of a reentrant checkpoint whose input needs no grad.
//
// Such a parameter arrives without a gradient, so a rank that skips a layer starts the group's
// buckets with the others and sends zeros in its place. It arrives at the group's first gradient
// of a planned backward (autograd's graph task lists the nodes it will run); in the first backward,
// or when a reentrant checkpoint may reach the group through graphs it makes later, at the end of
// the backward (the engine's final callback, of the backward that recomputes). Each reduction
// tells per parameter whether any rank had a gradient: if none had, its .grad is left as it was.
// A hooked parameter the backward does not reach has its hooks run on its reduced gradient (if
// any rank had one) when its .grad is completed.
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include "held_sums.h"
#include "param_group_impl.h"

namespace hyper_parallel::fully_shard {
namespace {

// At a group's first gradient of a backward: without sync (or without all-reduce), it will hold
// sums; with sync, the groups this backward does not reach reduce theirs at its end.
void note_or_queue_held_sums(const std::shared_ptr<ParamGroup::Impl>& group) {
  if (group->sync) detail::queue_reduce_of_held_sums();
  if (!group->sync || group->defers_all_reduce()) detail::note_held_sums(group);
}

}  // namespace

// Judged by the running graph task's nodes, and only when `current`'s node is this pass's (a
// second forward before this backward made other nodes) and this task lists it. The caller ends
// the backward if these were its last gradients. Called at a planned backward's first gradient
// of the group. Not for views a backward may reach through graphs made later (reentrant
// checkpoint's nested backwards each list only their own part): the end of the backward judges.
void ParamGroup::Impl::arrive_unreached(size_t current) {
  if (reached_later) return;
  const auto* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (nodes == nullptr || reduce_nodes[current] == nullptr || nodes->count(reduce_nodes[current]) == 0)
    return;
  arriving_unreached = true;
  for (size_t i = 0; i < params.size(); ++i) {
    if (planned_wants[i] == 0 || arrived[i] || reduce_nodes[i] == nullptr ||
        nodes->count(reduce_nodes[i]) > 0)
      continue;
    arrive_without_gradient(i);
  }
  arriving_unreached = false;
}

// Its hooks are not run (autograd does not reach it): its reduced gradient (the other ranks', or
// none) is deferred to .grad.
void ParamGroup::Impl::arrive_without_gradient(size_t i) {
  reached[i] = false;
  arrive(i, at::Tensor());
}

// At a group's first gradient of a backward, or when a recomputation inside it makes the views
// whose gradients it reduces (reentrant checkpoint's: its nested backwards each reach only their
// part): the end of the backward running now brings the gradients that did not arrive, and, if it
// syncs, the held sums of the groups it did not reach.
void ParamGroup::Impl::queue_end_of_backward(const std::shared_ptr<Impl>& group) {
  if (group->end_queued) return;
  group->end_queued = true;
  if (group->reduces_in_buckets()) {
    std::weak_ptr<Impl> weak = group;
    torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (auto g = weak.lock()) g->arrive_missing();
    });
  }
  note_or_queue_held_sums(group);
}

void ParamGroup::Impl::check_accumulating_backward(const std::vector<size_t>& indices) const {
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info == nullptr || exec_info->empty()) return;  // backward(): every leaf accumulates
  for (const auto i : indices) {
    if (!params[i].requires_grad()) continue;
    const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(params[i]);
    const auto it = accumulator == nullptr ? exec_info->end() : exec_info->find(accumulator.get());
    const bool captured = it != exec_info->end() && it->second.captures_ != nullptr;
    TORCH_CHECK_NOT_IMPLEMENTED(
        it != exec_info->end() && it->second.needed_ && !captured,
        "fully_shard: expected a backward that accumulates the gradients of the group's "
        "parameters, got one that ",
        captured ? c10::str("returns the gradient of ", names[i],
                            " (torch.autograd.grad): its reduced gradient goes to .grad; "
                            "call backward() and read .grad")
                 : c10::str("leaves out ", names[i],
                            " (inputs=): a group that reduces in one reduce-scatter "
                            "(comm_fusion=True) reduces all its parameters; name them all "
                            "in inputs=, or reduce in buckets (comm_fusion=False)"));
  }
}

void ParamGroup::Impl::arrive_missing() {
  std::vector<size_t> missing;
  for (size_t i = 0; arrivals > 0 && i < params.size(); ++i) {
    if (planned_wants[i] != 0 && !arrived[i]) missing.push_back(i);
  }
  for (const auto i : missing) arrive_without_gradient(i);
}

}  // namespace hyper_parallel::fully_shard
