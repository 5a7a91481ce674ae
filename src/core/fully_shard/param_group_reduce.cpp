// A fully_shard group's gradient reduction: one reduce-scatter once autograd has every gradient
// of the group, or buckets that leave as the gradients come (FullyShardOptions's
// reduce_bucket_cap_bytes).
//
// Unfused meaning, either way:  grad(shard_i) = reduce_scatter(dW_i, dim 0) / dp   for every i
// (dW_i of a rank that has none: zeros; no rank has one: grad(shard_i) is left as it was)
// Who waits on whom (buckets): each parameter's gradient reaches its own autograd node, which
// runs as soon as the gradient is complete (the highest priority among ready nodes, as
// AccumulateGrad's). In the first synced backward the gradients not yet sent leave in one
// reduce-scatter once they reach the cap (unless what is still to come is under a quarter of
// it), and the rest with the group's last gradient; each start agrees with the peers (kind,
// dtype, size: ranks whose buckets differ in size get an error). Those buckets, each
// laid out in parameter order, are the plan: a later backward starts a planned bucket once all
// its gradients are in and the ones before it have started, without a round trip, so every rank
// issues the same reduce-scatters in the same order whatever order its gradients come in (a
// parameter the backward does not reach: unreached_parameters.cpp). The shards' .grad wait for
// their bucket at the end of the backward (nn/pending_gradient.h). A parameter with gradient
// hooks ends its bucket; its node waits for the bucket and returns the reduced gradient, so
// autograd runs the hooks on it. A whole-group reduction agrees with the peers once: the later
// ones have its shape.
#include <algorithm>
#include <limits>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

#include <hyper_parallel/core/comm/pending_reduce_scatter.h>
#include <hyper_parallel/core/comm/row_sparse_reduce_scatter.h>
#include <hyper_parallel/core/nn/pending_gradient.h>

#include "../autograd/attach_backward.h"
#include "held_sums.h"
#include "param_group_impl.h"
#include "reduce_in_flight.h"

namespace hyper_parallel::fully_shard {
namespace {

bool has_hooks(const at::Tensor& param) { return !torch::autograd::impl::hooks(param).empty(); }

}  // namespace

std::shared_ptr<ParamGroup::Impl> detail::alive(const std::weak_ptr<ParamGroup::Impl>& weak) {
  auto self = weak.lock();
  TORCH_CHECK(self != nullptr,
              "fully_shard: expected the group of these parameters to be alive in backward, got it "
              "destroyed");
  return self;
}

int ParamGroup::Impl::wants(size_t i) const {
  return !params[i].requires_grad() ? 0 : has_hooks(params[i]) ? 2 : 1;
}

// Views a backward may reach through several graphs (reentrant checkpoint's) reduce in buckets
// even without a cap (one bucket: the one message's layout): one node per parameter, not one
// that runs when one graph has produced the whole group.
bool ParamGroup::Impl::reduces_in_buckets() const {
  return (bucket_cap_bytes > 0 || reached_later) && params.size() > 1 && row_sparse_cols == 0;
}

int64_t ParamGroup::Impl::bucket_cap() const {
  return bucket_cap_bytes > 0 ? bucket_cap_bytes : std::numeric_limits<int64_t>::max();
}

std::vector<at::Tensor> ParamGroup::Impl::attach_reduction(const std::shared_ptr<Impl>& group,
                                                           std::vector<at::Tensor> views) {
  std::weak_ptr<Impl> weak = group;
  auto& s = *group;
  if (s.pending.size() != s.params.size()) s.pending.assign(s.params.size(), at::Tensor());
  if (!torch::autograd::GradMode::is_enabled()) return views;
  s.check_no_hooks_for_main_grad();
  s.end_queued = false;
  if (!s.reduces_in_buckets()) {
    return hyper_parallel::detail::attach_backward(
        s.params, std::move(views),
        [weak](std::vector<at::Tensor> grads) {
          auto self = detail::alive(weak);
          self->check_accumulating_backward(self->all_params());
          // Part of the pass ran in a reentrant checkpoint: this graph brings only the rest.
          if (self->reduces_in_buckets()) return self->arrive_each(self, std::move(grads));
          queue_end_of_backward(self);
          auto out = self->reduce(std::move(grads));
          self->end_backward();
          return out;
        },
        "FullyShardReduceScatterBackward", /*materialize_grads=*/false);
  }
  s.begin_backward_pass();
  return attach_per_parameter(group, std::move(views));
}

std::vector<at::Tensor> ParamGroup::Impl::attach_per_parameter(const std::shared_ptr<Impl>& group,
                                                               std::vector<at::Tensor> views) {
  std::weak_ptr<Impl> weak = group;
  auto& s = *group;
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < s.params.size(); ++i) {
    out.push_back(hyper_parallel::detail::attach_backward(
        {s.params[i]}, {std::move(views[i])},
        [weak, i](std::vector<at::Tensor> grads) {
          auto self = detail::alive(weak);
          self->check_accumulating_backward({i});
          if (self->arrivals == 0) queue_end_of_backward(self);
          return std::vector<at::Tensor>{self->arrive(i, std::move(grads[0]))};
        },
        "FullyShardReduceScatterBackward", /*materialize_grads=*/false,
        /*sequence_nr=*/std::numeric_limits<uint64_t>::max())[0]);
    s.reduce_nodes[i] = out.back().grad_fn().get();
  }
  return out;
}

void ParamGroup::Impl::begin_backward_pass() {
  const auto n = params.size();
  arrived.assign(n, false);
  arrived_grads.assign(n, at::Tensor());
  reduce_of.assign(n, nullptr);
  offset_of.assign(n, 0);
  slot_of.assign(n, 0);
  reduce_nodes.assign(n, nullptr);
  reached.assign(n, true);
  // A backward that failed part-way leaves no arrivals and no half-recorded plan behind.
  unsent.clear();
  unsent_bytes = 0;
  arrivals = 0;
  recorded_plan.clear();
  next_bucket = 0;
  expected_arrivals = 0;
  expected_bytes = 0;
  std::vector<int> now_wants;
  for (size_t i = 0; i < n; ++i) {
    now_wants.push_back(wants(i));
    if (now_wants.back() == 0) continue;
    ++expected_arrivals;
    expected_bytes += reduce_bytes(i);
  }
  // A parameter frozen, unfrozen or hooked since the plan was made: the next synced backward
  // makes another.
  if (now_wants != planned_wants) bucket_plan.clear();
  planned_wants = std::move(now_wants);
}

std::vector<at::Tensor> ParamGroup::Impl::arrive_each(const std::shared_ptr<Impl>& self,
                                                      std::vector<at::Tensor> grads) {
  if (self->arrivals == 0) queue_end_of_backward(self);
  std::vector<at::Tensor> out(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined() || self->planned_wants[i] == 0) continue;
    // A parameter that a reentrant region's recomputation read itself has arrived with that
    // read's gradient: this graph's is the rest of it.
    if (self->arrived[i]) {
      self->reduce_alone(i, std::move(grads[i]));
    } else {
      out[i] = self->arrive(i, std::move(grads[i]));
    }
  }
  return out;
}

// Added to the kept sum when the backward completes (nn/pending_gradient.h): a backward that
// fails part-way adds nothing, so its retry finds the sums as they were.
void ParamGroup::Impl::accumulate(size_t i, const at::Tensor& grad) {
  std::weak_ptr<Impl> weak = shared_from_this();
  nn::defer_completion(
      params[i], [g = grad.to(reduce_dtype.value_or(grad.scalar_type()))] { return g; },
      [weak, i](const at::Tensor& g) {
        auto self = weak.lock();
        if (self == nullptr) return;
        // A group holding sums is on the list; one that held none may have left it at this
        // backward's end, before this completion ran.
        const bool was_holding = self->holds_sums();
        self->pending[i] = self->pending[i].defined() ? self->pending[i] + g : g;
        if (!was_holding) detail::note_held_sums(self);
      });
}

at::Tensor ParamGroup::Impl::arrive(size_t i, at::Tensor grad) {
  // Two passes of the group whose views reach one reduction: a module run twice under a
  // reentrant checkpoint (each recomputation's views), or a second forward that skipped some of
  // the group's modules before one backward that reduces in buckets.
  TORCH_CHECK_NOT_IMPLEMENTED(
      !arrived[i], "fully_shard: expected one gradient of ", names[i],
      " per backward of its group, got a second one from another pass of the group (a module run twice "
      "under a reentrant checkpoint, or a second forward that skipped some of the group's modules); "
      "checkpoint with use_reentrant=False, give the repeated module a fully_shard call of its own, or set "
      "comm_fusion=True");
  arrived[i] = true;
  ++arrivals;
  // Autograd runs the hooks of a parameter this backward reaches: its node returns the reduced
  // gradient (not while the all-reduce is deferred: the one that completes it runs them). One it
  // does not reach has its zeros reduced and deferred like the others'.
  const bool hooked = planned_wants[i] == 2 && reached[i];
  TORCH_CHECK_VALUE(planned_wants[i] == 2 || !has_hooks(params[i]),
                    "fully_shard: expected the gradient hooks of ", names[i],
                    " to be registered before the forward (its group reduces in buckets that the forward "
                    "plans), got one registered after it; register it earlier, or set "
                    "reduce_bucket_cap_bytes to 0");
  at::Tensor out;
  if (!sync) {
    if (grad.defined()) accumulate(i, grad);
  } else {
    arrived_grads[i] = std::move(grad);
    if (!bucket_plan.empty()) {
      // At the group's first gradient, the parameters this backward does not reach (a layer
      // skipped in this step, on this rank only or on all) reduce zeros: every rank then starts
      // the group's buckets during its backward, in the plan's order, before the next group's.
      if (arrivals == 1) arrive_unreached(i);
      send_planned();
    } else {
      unsent_bytes += reduce_bytes(i);
      unsent.push_back(i);
      // A full bucket leaves, unless what is still to come is small: it would leave alone and
      // wait for its start behind this one on the link. A parameter with hooks ends its bucket.
      if (hooked || (unsent_bytes >= bucket_cap() && expected_bytes - arrived_bytes() >= bucket_cap() / 4))
        send_unsent();
    }
    // Its hooks see the reduced gradient: autograd gets it here, and runs them.
    if (hooked && !defers_all_reduce()) out = hooked_gradient(i);
  }
  if (arrivals == expected_arrivals && !arriving_unreached) end_backward();
  return out;
}

// The planned buckets whose gradients have all arrived, in the plan's order.
void ParamGroup::Impl::send_planned() {
  while (next_bucket < bucket_plan.size()) {
    const auto& bucket = bucket_plan[next_bucket];
    if (!std::all_of(bucket.begin(), bucket.end(),
                     [this](size_t i) { return static_cast<bool>(arrived[i]); }))
      return;
    ++next_bucket;
    send(bucket, comm::Agreement::kAgreedInAdvance);
  }
}

at::Tensor ParamGroup::Impl::hooked_gradient(size_t i) {
  TORCH_CHECK(reduce_of[i] != nullptr, "fully_shard: expected the bucket of ", names[i],
              " (a parameter with gradient hooks) to have started when its gradient arrived, got it ",
              reached_later ? "waiting for parameters that a part of the group's forward run without grad "
                              "(a reentrant checkpoint's region) may still reach; use "
                              "torch.utils.checkpoint with use_reentrant=False"
                            : "waiting for gradients that came before it in the first backward; set "
                              "reduce_bucket_cap_bytes to 0 for a backward whose order changes");
  return shard_gradient(reduce_of[i], params[i], offset_of[i], layout.local_elements(static_cast<int64_t>(i)),
                        slot_of[i]);
}

int64_t ParamGroup::Impl::reduce_bytes(size_t i) const {
  return buffers[i].numel() *
         static_cast<int64_t>(c10::elementSize(reduce_dtype.value_or(buffers[i].scalar_type())));
}

int64_t ParamGroup::Impl::arrived_bytes() const {
  int64_t bytes = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    if (arrived[i]) bytes += reduce_bytes(i);
  }
  return bytes;
}

void ParamGroup::Impl::send_unsent() {
  if (unsent.empty()) return;
  // In parameter order: the bucket's layout does not depend on the order of arrival.
  auto indices = std::move(unsent);
  std::sort(indices.begin(), indices.end());
  unsent.clear();
  unsent_bytes = 0;
  recorded_plan.push_back(indices);
  send(indices, comm::Agreement::kPerOp);
}

void ParamGroup::Impl::send(const std::vector<size_t>& indices, comm::Agreement agreement) {
  const auto reduced = start_reduce(indices, arrived_grads, agreement);
  int64_t offset = 0;
  for (size_t slot = 0; slot < indices.size(); ++slot) {
    const auto i = indices[slot];
    reduce_of[i] = reduced;
    offset_of[i] = offset;
    slot_of[i] = slot;
    // Autograd does not reach a hooked parameter that got here unreached: its hooks run on the
    // reduced gradient here (from unsynced micro-batches or other ranks' gradients).
    if (planned_wants[i] == 1 || !reached[i] || reduced->held)
      defer_to_grad(reduced, i, offset, slot, planned_wants[i] == 2);
    offset += layout.padded_elements(static_cast<int64_t>(i));
  }
}

void ParamGroup::Impl::end_backward() {
  if (sync && reduces_in_buckets() && bucket_plan.empty()) {
    send_unsent();
    // The first synced backward's buckets, each agreed with the peers as it started, are the
    // plan from now on: the later ones start without a round trip, in the same order on every
    // rank whatever order their gradients come in.
    bucket_plan = std::move(recorded_plan);
  } else if (sync && reduces_in_buckets()) {
    TORCH_INTERNAL_ASSERT(next_bucket == bucket_plan.size(),
                          "fully_shard: a planned bucket did not start by the end of its group's backward");
  }
  recorded_plan.clear();
  next_bucket = 0;
  arrivals = 0;
  arrived.assign(params.size(), false);
  reached.assign(params.size(), true);
  reduce_of.assign(params.size(), nullptr);
  forward_calls = 0;
  backward_prefetched = false;
  backward_began = false;
  grad_views.clear();
  end_queued = false;
  // The group's last backward use is over, unless the module's backward views still stand, or
  // the next forward is to find it gathered.
  if (!reshard_after_backward) return;
  if (views_out) {
    free_when_released = true;
  } else {
    free_buffers();
  }
}

// Every rank's blocks of parameters `indices`' gradients (plus the sums kept while sync was off),
// in the reduce dtype, one parameter after the other, then a flag per parameter: the
// reduce-scatter's input. Reduced, a flag says whether any rank had a gradient for it; if none
// had (a layer every rank skipped), its .grad is left as it was, as in one process (and as
// DDP and FSDP2 leave it), so an optimizer skips it.
std::shared_ptr<detail::ReduceInFlight> ParamGroup::Impl::start_reduce(const std::vector<size_t>& indices,
                                                                       std::vector<at::Tensor>& grads,
                                                                       comm::Agreement agreement) {
  detail::bound_reduces_in_flight(this);
  const auto& first = buffers[indices[0]];
  const auto dtype = reduce_dtype.value_or(first.scalar_type());
  // A dense reduction's blocks end with one flag per parameter (row-sparse: one parameter,
  // whose rows must stay whole).
  const int64_t flags = row_sparse_cols > 0 ? 0 : static_cast<int64_t>(indices.size());
  std::vector<detail::TakenSums> taken;
  int64_t elements = 0;
  for (const auto i : indices) elements += layout.padded_elements(static_cast<int64_t>(i));
  auto input = at::zeros({shard_group.size(), elements + flags}, first.options().dtype(dtype));
  int64_t offset = 0;
  for (size_t slot = 0; slot < indices.size(); ++slot) {
    const auto i = indices[slot];
    const auto padded = layout.padded_elements(static_cast<int64_t>(i));
    at::Tensor total;  // none: this rank has no gradient for it (it reduces zeros)
    if (grads[i].defined()) total = grads[i].to(dtype);
    if (pending[i].defined()) total = total.defined() ? total + pending[i].to(dtype) : pending[i].to(dtype);
    if (total.defined()) {
      input.narrow(1, offset, padded).copy_(layout.padded_blocks(total, static_cast<int64_t>(i)));
      if (flags > 0) input.select(1, elements + static_cast<int64_t>(slot)).fill_(1);
    }
    if (pending[i].defined()) taken.push_back({i, std::move(pending[i]), {}, false});
    pending[i] = at::Tensor();
    grads[i] = at::Tensor();
    offset += padded;
  }
  auto flat = input.view({-1});
  auto in_flight = std::make_shared<detail::ReduceInFlight>();
  in_flight->content = content_of(indices);
  // The average (or sum) over every data-parallel rank: over the shard dim, then the replicate dim.
  if (shard_group.size() == 1) {
    in_flight->unreduced = std::move(flat);
  } else if (row_sparse_cols > 0) {
    in_flight->pending = comm::start_row_sparse_reduce_scatter(flat, row_sparse_cols, reduce_op, shard_group,
                                                               agreement, in_flight->content);
  } else {
    in_flight->pending =
        comm::start_reduce_scatter(flat, reduce_op, shard_group, agreement, in_flight->content);
  }
  in_flight->taken = std::move(taken);
  take_partial(indices, elements, flags, dtype, *in_flight);
  in_flight->replicate = replicate_group;
  in_flight->op = reduce_op;
  in_flight->held = defers_all_reduce();
  in_flight->scale = scale;
  in_flight->flags = flags;
  detail::track_reduce_in_flight(this, in_flight);
  return in_flight;
}

// The whole group's gradients in one reduce-scatter; each shard's gradient is handed to
// nn::defer_gradient (the backward goes on while it travels), or, in a group with gradient
// hooks, waited for here and returned to autograd.
std::vector<at::Tensor> ParamGroup::Impl::reduce(std::vector<at::Tensor> grads) {
  std::vector<at::Tensor> out(params.size());
  if (!sync) {
    for (size_t i = 0; i < grads.size(); ++i) {
      if (grads[i].defined()) accumulate(i, grads[i]);
    }
    return out;
  }
  // A frozen parameter keeps its sum until a synced backward after it is unfrozen (as in buckets,
  // whose plan leaves it out): the message carries its slot without it.
  std::vector<at::Tensor> kept(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].requires_grad()) std::swap(kept[i], pending[i]);
  }
  // The group's first reduce-scatter is agreed with the peers; the later ones have its shape.
  const auto reduced = start_reduce(
      all_params(), grads, reduced_whole ? comm::Agreement::kAgreedInAdvance : comm::Agreement::kPerOp);
  reduced_whole = true;
  for (size_t i = 0; i < params.size(); ++i) {
    if (kept[i].defined()) pending[i] = std::move(kept[i]);
  }
  check_no_hooks_for_main_grad();  // registered since the forward
  const bool hooked = !reduced->held && std::any_of(params.begin(), params.end(), has_hooks);
  int64_t offset = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].requires_grad()) {
      if (hooked) {
        out[i] =
            shard_gradient(reduced, params[i], offset, layout.local_elements(static_cast<int64_t>(i)), i);
      } else {
        defer_to_grad(reduced, i, offset, i, /*run_hooks=*/false);
      }
    }
    offset += layout.padded_elements(static_cast<int64_t>(i));
  }
  return out;
}

}  // namespace hyper_parallel::fully_shard
