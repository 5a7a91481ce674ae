#include "held_sums.h"

#include <algorithm>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>

#include "param_group_impl.h"
#include "reduce_in_flight.h"

namespace hyper_parallel::fully_shard::detail {
namespace {

struct HeldSums {
  std::vector<std::weak_ptr<ParamGroup::Impl>> groups;  // by serial, the order they were made
  bool queued = false;                                  // this backward's reduction is queued
};

HeldSums& held_sums() {
  static HeldSums held;
  return held;
}

}  // namespace

void note_held_sums(const std::shared_ptr<ParamGroup::Impl>& group) {
  auto& groups = held_sums().groups;
  groups.erase(std::remove_if(groups.begin(), groups.end(), [](const auto& w) { return w.expired(); }),
               groups.end());
  const auto at = std::find_if(groups.begin(), groups.end(),
                               [&group](const auto& w) { return w.lock()->serial >= group->serial; });
  if (at == groups.end() || at->lock() != group) groups.insert(at, group);
}

void queue_reduce_of_held_sums() {
  auto& held = held_sums();
  if (held.queued || held.groups.empty()) return;
  held.queued = true;
  // Cleared when the callback is gone too: a backward that failed before its callbacks ran.
  struct Unqueue {
    ~Unqueue() { held_sums().queued = false; }
  };
  torch::autograd::Engine::get_default_engine().queue_callback([unqueue = std::make_shared<Unqueue>()] {
    auto& h = held_sums();
    h.queued = false;
    const auto groups = h.groups;  // a copy: the loop's reductions must not see the list change
    for (const auto& weak : groups) {
      if (auto group = weak.lock()) group->reduce_held_sums();
    }
    auto& kept = h.groups;
    kept.erase(std::remove_if(kept.begin(), kept.end(),
                              [](const auto& w) {
                                // A group that defers its all-reduce holds its sums once
                                // this backward's reduce-scatters are waited for, maybe later.
                                auto group = w.lock();
                                return group == nullptr ||
                                       !(group->holds_sums() || group->defers_all_reduce());
                              }),
               kept.end());
  });
}

}  // namespace hyper_parallel::fully_shard::detail

namespace hyper_parallel::fully_shard {

namespace {

bool any_defined(const std::vector<at::Tensor>& tensors) {
  return std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) { return t.defined(); });
}

}  // namespace

bool ParamGroup::Impl::holds_sums() const { return any_defined(pending) || holds_partial_sums(); }

bool ParamGroup::Impl::holds_partial_sums() const { return any_defined(partial); }

bool ParamGroup::Impl::defers_all_reduce() const {
  return !all_reduce && replicate_group && replicate_group->size() > 1;
}

void ParamGroup::Impl::hold_partial(size_t i, const at::Tensor& block, bool reached_anywhere) {
  if (partial.size() != params.size()) {
    partial.assign(params.size(), at::Tensor());
    partial_reached.assign(params.size(), false);
  }
  partial[i] = partial[i].defined() ? partial[i] + block : block.clone();
  partial_reached[i] = partial_reached[i] || reached_anywhere;
}

// A frozen parameter keeps its partial sum until a reduction after it is unfrozen, as its sum
// kept while sync was off.
void ParamGroup::Impl::take_partial(const std::vector<size_t>& indices, int64_t elements, int64_t flags,
                                    at::ScalarType dtype, detail::ReduceInFlight& into) {
  auto& out = into.partial;
  int64_t offset = 0;
  for (size_t slot = 0; slot < indices.size(); ++slot) {
    const auto i = indices[slot];
    const auto padded = layout.padded_elements(static_cast<int64_t>(i));
    if (i < partial.size() && partial[i].defined() && params[i].requires_grad()) {
      if (!out.defined()) out = at::zeros({elements + flags}, partial[i].options().dtype(dtype));
      out.narrow(0, offset, padded).copy_(partial[i]);
      if (flags > 0 && partial_reached[i]) out[elements + static_cast<int64_t>(slot)].fill_(1);
      into.taken.push_back({i, {}, std::move(partial[i]), partial_reached[i]});
      partial[i] = at::Tensor();
      partial_reached[i] = false;
    }
    offset += padded;
  }
}

void ParamGroup::Impl::put_back(const detail::ReduceInFlight& reduce, size_t i) {
  bool held_again = false;
  for (const auto& t : reduce.taken) {
    if (t.param != i) continue;
    if (t.pending.defined()) pending[i] = pending[i].defined() ? pending[i] + t.pending : t.pending;
    if (t.partial.defined()) hold_partial(i, t.partial, t.partial_reached);
    held_again = held_again || t.pending.defined() || t.partial.defined();
  }
  if (held_again) detail::note_held_sums(shared_from_this());
}

// A group this synced backward did not reach holds the sums of the unsynced ones, or
// reduce-scattered sums waiting for the all-reduce: reduced now, as its next synced backward
// would (agreed per op: ranks must hold the same sums), so this step's optimizer sees every
// micro-batch. Autograd reaches none of these parameters: their hooks run on the reduced
// gradient when .grad is completed.
void ParamGroup::Impl::reduce_held_sums() {
  // arrivals > 0: reached, its own end of backward reduces them. Sent by every rank that holds
  // any sum, a frozen parameter's included (it keeps that sum), for every parameter that wants a
  // gradient, whichever this rank holds a sum for (another rank may hold one: its flag tells), so
  // that every rank's message has one layout.
  // Sums held for the all-reduce alone wait while it is deferred (no reduce-scatter adds to them).
  if (!sync || arrivals > 0 || !holds_sums() || (defers_all_reduce() && !any_defined(pending))) return;
  std::vector<size_t> indices;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].requires_grad()) indices.push_back(i);
  }
  if (indices.empty()) return;
  std::vector<at::Tensor> grads(params.size());
  const auto reduced = start_reduce(indices, grads, comm::Agreement::kPerOp);
  int64_t offset = 0;
  for (size_t slot = 0; slot < indices.size(); ++slot) {
    const auto i = indices[slot];
    defer_to_grad(reduced, i, offset, slot, /*run_hooks=*/wants(i) == 2);
    offset += layout.padded_elements(static_cast<int64_t>(i));
  }
}

}  // namespace hyper_parallel::fully_shard
