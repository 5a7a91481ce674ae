// A fully_shard group's forward calls: the pass they make (one gather, views with a reduction
// attached, the reshard at its end), calls nested in an open one, and the node on the outputs
// that gathers the group again before its backward. A forward inside a backward is
// recomputation.cpp's.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <hyper_parallel/core/dtensor/dtensor.h>

#include "../autograd/attach_backward.h"
#include "param_group_impl.h"

namespace hyper_parallel::fully_shard {

// A pass ends when every user has run, or with its backward. One that skipped a user ends with
// neither if it had no backward: its views were made without grad (an evaluation, or the part of
// the group a reentrant checkpoint runs), and this forward needs gradients; or its backward began
// and failed; or its gathered parameters are gone or stale (pass_outdated). A new pass begins.
bool ParamGroup::Impl::pass_left_open() const {
  if (pass_outdated()) return true;
  if (!gathered_with_grad) return torch::autograd::GradMode::is_enabled();
  return backward_began;
}

// A pass whose users did not all run (a forward that raised part-way, or one module of the group
// called on its own) and whose gathered parameters are gone or were gathered from other values
// than the shards hold now (an optimizer step since): its views must not be read again.
bool ParamGroup::Impl::pass_outdated() const { return !unsharded || shards_changed(); }

void ParamGroup::Impl::gather_for_forward(const at::Tensor& rows) {
  if (unsharded && shards_changed()) {  // gathered ahead (unshard), then changed in place
    ++stats.regathered;
    free_buffers();
  }
  if (rows_by_id && rows.defined() && !unsharded && !gather_in_flight) {
    gather_rows(rows);
  } else {
    finish_gather();
  }
}

void ParamGroup::Impl::prefetch_next_backward(const std::shared_ptr<Impl>& self) {
  if (backward_prefetched) return;
  backward_prefetched = true;
  // An embedding's backward reads no weight: a row-sparse group is not gathered for it.
  auto next = order->next_backward(self);
  if (next && next->row_sparse_cols == 0) next->start_gather();
}

// The gathered buffers as views without autograd (a forward without grad).
std::vector<at::Tensor> ParamGroup::Impl::plain_views() const {
  std::vector<at::Tensor> views;
  for (const auto& b : buffers) views.push_back(b.detach());
  return views;
}

const std::vector<at::Tensor>& ParamGroup::pre_forward(const at::Tensor& rows,
                                                       const std::function<void()>& prefetch, Caller caller) {
  auto& s = *impl_;
  // The sharded module's forward is never inside another of the group's: a count left open (by
  // a forward that raised) is over.
  if (caller == Caller::kShardedModule) s.open_calls = 0;
  // An open call keeps the group gathered: a count that a forward which threw left behind, with
  // the group freed or its shards changed since (an optimizer step), is over too (its views
  // must not be read).
  if (s.open_calls > 0 && s.pass_outdated()) s.open_calls = 0;
  if (s.open_calls > 0) {
    ++s.open_calls;
    // A region of the pass that runs without grad (a reentrant checkpoint's) is one that a
    // nested backward brings the gradients of.
    if (!Impl::in_backward() && s.gathered_with_grad && !torch::autograd::GradMode::is_enabled())
      s.note_part_without_grad();
    return s.gathered;
  }
  s.open_calls = 1;
  if (Impl::in_backward()) return Impl::recompute(impl_, rows);
  const auto& gathered = Impl::forward_pass(impl_, rows);
  if (prefetch) prefetch();
  return gathered;
}

const std::vector<at::Tensor>& ParamGroup::Impl::forward_pass(const std::shared_ptr<Impl>& group,
                                                              const at::Tensor& rows) {
  auto& s = *group;
  const bool grad = torch::autograd::GradMode::is_enabled();
  // Views with grad after a part of the pass ran without: a reentrant checkpoint's, perhaps.
  const bool after_part_without_grad = s.forward_calls > 0 && !s.gathered_with_grad && grad;
  if (s.forward_calls > 0 && s.pass_left_open()) s.forward_calls = 0;
  if (s.forward_calls > 0) {
    if (s.gathered_with_grad && !grad) s.note_part_without_grad();
    return s.gathered;
  }
  // A new pass has its own backward to come, even if the last one never ended the group's (its
  // parameters frozen).
  s.backward_began = false;
  s.backward_prefetched = false;
  s.order->first_use.record(group);
  s.gather_for_forward(rows);
  // A group that gathers rows by id is not prefetched: its forward gathers only the rows it reads.
  if (auto next = s.order->next_forward(group); next && !next->rows_by_id) next->start_gather();
  // A pass without grad (an evaluation) leaves the state of the last one with grad, whose
  // backward may still come (and recompute).
  if (grad) s.reached_later = s.part_without_grad = after_part_without_grad;
  // Views a failed backward never released (gather_for_forward above gathered again if the
  // shards changed since).
  s.views_out = s.free_when_released = false;
  s.gathered = Impl::attach_reduction(group, s.plain_views());
  if (grad) s.grad_views = s.gathered;
  s.gathered_with_grad = grad;
  return s.gathered;
}

bool ParamGroup::post_forward(Caller caller) {
  auto& s = *impl_;
  // The sharded module's forward is the outermost call: one of its owners that raised and was
  // caught inside it left its call open, which ends here.
  if (s.open_calls > 1 && caller == Caller::kOwner) {
    --s.open_calls;
    return false;
  }
  s.open_calls = 0;
  if (Impl::in_backward()) {
    // A recomputation's group stays gathered: the backward frees it when the group's is over. A
    // forward without grad in a backward (a hook's) reshards a group whose backward is not under
    // way, as a forward would.
    if (!torch::autograd::GradMode::is_enabled() && s.reshard_after_forward && !s.backward_began)
      s.free_buffers();
    return true;
  }
  if (caller == Caller::kOwner && ++s.forward_calls < s.users) return true;
  s.forward_calls = 0;
  s.order->last_use.record(impl_);
  if (s.reshard_after_forward) s.free_buffers();
  return true;
}

void ParamGroup::abandon_forward() {
  impl_->open_calls = 0;
  impl_->forward_calls = 0;
}

std::vector<at::Tensor> ParamGroup::register_pre_backward(std::vector<at::Tensor> outputs,
                                                          const std::function<void()>& then) {
  if (!torch::autograd::GradMode::is_enabled()) return outputs;
  std::weak_ptr<Impl> weak = impl_;
  const int64_t made = impl_->generation;
  auto read = std::make_shared<const std::vector<detail::ShardState>>(impl_->shard_states());
  for (auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    auto wrapped = hyper_parallel::detail::attach_backward(
        out, out.detach(),
        [weak, then, made, read](const at::Tensor& grad) {
          // Before the module's own backward reads its parameters: gather them if resharded,
          // and start the gather of the group whose backward comes next.
          if (auto self = weak.lock()) {
            self->check_not_converted_since(made);
            self->check_unchanged_since(*read);
            self->backward_began = true;
            // An embedding's backward reads no weight: a row-sparse group is not gathered again.
            if (self->row_sparse_cols == 0) self->finish_gather();
            // Once per backward of the group: a module of it that runs its backward late (the
            // root's embedding, last) must not gather a group whose backward is over.
            self->prefetch_next_backward(self);
          }
          if (then) then();
          return grad;
        },
        "FullyShardPreBackward");
    hyper_parallel::detail::mark_identity(*wrapped.grad_fn());  // a layout traced back passes through
    out = dtensor::DTensor::carry_tag(out, wrapped);            // a style's use_local_output=false
  }
  return outputs;
}

}  // namespace hyper_parallel::fully_shard
