// A fully_shard group's forward run again inside the backward: activation checkpointing's
// recomputation. Both variants of torch.utils.checkpoint are supported.
//
// The non-reentrant variant runs the forward with grad inside the backward and reads only the
// tensors the recomputation saves: the group's views of its last pass with grad are reused, and
// the group stays gathered until its backward ends. The reentrant variant runs its region without
// grad in the forward, and its backward as a nested one: the part of a pass that ran without grad
// makes views of its own, whose gradients join the pass's arrivals, and the end of the group's
// backward is queued on the outer backward (unreached_parameters.cpp). A recomputation records
// no pass order and prefetches no later forward; it prefetches the group whose backward comes
// next. A forward without grad inside a backward (a hook's) is not a recomputation.
//
// A region that reads a parameter itself (not through its module's forward) has no hook to
// stand the gathered parameters in: the owning modules hold the backward views while the
// module's backward runs (from its outputs' gradients to its inputs', or to the end of the
// backward), as FSDP2's unsharded parameters stand from its pre- to its post-backward; the
// group's buffers stay until then even if its reduction is over, since the region's
// recomputation may come later. The non-reentrant variant reads the views' values only. The
// reentrant variant's nested backward brings their gradients: one arrives in the group's
// reduction if it still takes it (a bucketed one under way, the parameter not yet arrived);
// otherwise (the outer backward judged the parameter unreached, or the reduction is over) it is
// reduced on its own, and the shard's .grad gets the sum of the two reductions.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>

#include "../autograd/attach_backward.h"
#include "param_group_impl.h"

namespace hyper_parallel::fully_shard {

bool ParamGroup::Impl::in_backward() {
  return torch::autograd::get_current_graph_task_nodes_in_graph() != nullptr;
}

// A pass with grad whose module now runs without (the region of a reentrant checkpoint, whose
// recomputation's nested backward brings that part's gradients): the parameters the backward
// does not reach are judged at its end, and a whole-group node (no cap) hands its gradients to
// the per-parameter arrivals, which that part's views add to.
void ParamGroup::Impl::note_part_without_grad() {
  if (part_without_grad) return;
  part_without_grad = true;
  const bool whole_group_node = !reduces_in_buckets();
  reached_later = true;
  if (whole_group_node && reduces_in_buckets()) begin_backward_pass();
}

// checkpoint's recomputation (a forward with grad inside the backward). The pass order and the
// next forward's prefetch are the forward's: it leaves them.
const std::vector<at::Tensor>& ParamGroup::Impl::recompute(const std::shared_ptr<Impl>& group,
                                                           const at::Tensor& rows) {
  auto& s = *group;
  // The pass it recomputes kept views of the current buffers (remade buffers drop them): a cast
  // since, which the gather below would follow, is refused.
  if (!s.grad_views.empty()) s.check_not_converted_since(s.generation);
  s.gather_for_forward(rows);
  if (!torch::autograd::GradMode::is_enabled()) {  // not checkpoint's (a hook's forward): no pass
    s.gathered = s.plain_views();
    return s.gathered;
  }
  s.backward_began = true;
  s.prefetch_next_backward(group);
  if (!s.grad_views.empty() && (!s.part_without_grad || !s.reduces_in_buckets())) {
    s.gathered = s.grad_views;  // the non-reentrant variant reads only its saved tensors
    return s.gathered;
  }
  if (s.grad_views.empty()) {
    // The reentrant variant ran the whole pass without grad: views with grad start this
    // backward's reduction, which its nested backwards each reach in part.
    s.reached_later = s.part_without_grad = true;
    s.gathered = Impl::attach_reduction(group, s.plain_views());
    s.grad_views = s.gathered;
  } else {
    // The part of the pass that ran without grad: views of its own, whose gradients (from the
    // nested backward) add to the pass's arrivals.
    s.gathered = Impl::attach_per_parameter(group, s.plain_views());
  }
  // The backward running now (the reentrant variant's outer one) ends the group's.
  queue_end_of_backward(group);
  return s.gathered;
}

std::vector<at::Tensor> ParamGroup::backward_views() {
  auto& s = *impl_;
  if (s.row_sparse_cols > 0 || s.open_calls > 0) return {};
  // Asked for by a hook on the module's outputs, which may run before their pre-backward node
  // gathers the group again (resharded after the forward): the views must not be of freed buffers.
  s.finish_gather();
  s.views_out = true;
  // Made in the backward, where grad mode is off: a nested backward must reach their nodes.
  const at::AutoGradMode grad_mode(true);
  std::weak_ptr<Impl> weak = impl_;
  auto views = s.plain_views();
  for (size_t i = 0; i < views.size(); ++i) {
    views[i] = hyper_parallel::detail::attach_backward(
        {s.params[i]}, {std::move(views[i])},
        [weak, i](std::vector<at::Tensor> grads) {
          auto self = detail::alive(weak);
          self->check_accumulating_backward({i});
          return std::vector<at::Tensor>{self->reduce_read_in_backward(i, std::move(grads[0]))};
        },
        "FullyShardReadInBackward")[0];
  }
  return views;
}

void ParamGroup::release_backward_views() {
  auto& s = *impl_;
  s.views_out = false;
  if (s.free_when_released) {
    s.free_when_released = false;
    s.free_buffers();
  }
}

at::Tensor ParamGroup::Impl::reduce_read_in_backward(size_t i, at::Tensor grad) {
  // An arrival before this one queued the reduction's end on the outer backward.
  if (reduces_in_buckets() && arrivals > 0 && !arrived[i]) return arrive(i, std::move(grad));
  reduce_alone(i, std::move(grad));
  return {};  // .grad gets it when the reduction is waited for
}

void ParamGroup::Impl::reduce_alone(size_t i, at::Tensor grad) {
  if (!sync) {
    accumulate(i, grad);
    return;
  }
  std::vector<at::Tensor> grads(params.size());
  grads[i] = std::move(grad);
  defer_to_grad(start_reduce({i}, grads, comm::Agreement::kPerOp), i, /*offset=*/0, /*slot=*/0,
                /*run_hooks=*/wants(i) == 2);
}

}  // namespace hyper_parallel::fully_shard
