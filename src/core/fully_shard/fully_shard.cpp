#include <hyper_parallel/core/fully_shard/fully_shard.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <hyper_parallel/core/dtensor/dtensor.h>
#include <hyper_parallel/core/nn/embedding.h>
#include <hyper_parallel/core/nn/hookable_module.h>
#include <hyper_parallel/core/nn/main_grad.h>

namespace hyper_parallel::fully_shard {

struct FSDPModule::State {
  std::weak_ptr<torch::nn::Module> module;  // empty for a module no shared_ptr owns
  bool owned = false;
  // A module no shared_ptr owns, known by its address: its children then, which another module
  // made at that address later does not have (a state with a group lives as long as the hooks
  // on the module's own modules; one without is kept by the registry, so this tells it gone).
  std::vector<std::weak_ptr<torch::nn::Module>> children;
  std::shared_ptr<ParamGroup> group;          // null when nested calls took everything
  std::vector<std::shared_ptr<State>> below;  // managed modules under this one
  std::vector<std::weak_ptr<State>> forward_prefetch, backward_prefetch;
  MixedPrecisionPolicy mp_policy;
};

namespace {

using State = FSDPModule::State;

// The modules fully_shard was applied to, by address. A state lives as long as the hooks it
// installed on the module's own modules (they hold it), so an entry whose state is gone is a
// module gone; a state with no group (nested calls took every parameter) holds no tensor and is
// kept here.
struct Registry {
  struct Entry {
    std::weak_ptr<State> state;
    std::shared_ptr<State> keep;
  };
  std::mutex mutex;
  std::unordered_map<const torch::nn::Module*, Entry> by_module;
};

Registry& registry() {
  static Registry r;
  return r;
}

bool same_children(const torch::nn::Module& module,
                   const std::vector<std::weak_ptr<torch::nn::Module>>& then) {
  const auto now = module.children();
  if (now.size() != then.size()) return false;
  for (size_t i = 0; i < now.size(); ++i) {
    if (then[i].lock() != now[i]) return false;
  }
  return true;
}

std::shared_ptr<State> state_of(const torch::nn::Module& module) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.by_module.find(&module);
  if (it == r.by_module.end()) return nullptr;
  auto state = it->second.state.lock();
  // A module gone and another at its address is another one.
  if (!state || (state->owned && state->module.lock().get() != &module) ||
      (!state->owned && !state->group && !same_children(module, state->children))) {
    r.by_module.erase(it);
    return nullptr;
  }
  return state;
}

// The modules under `root` (itself included) with the parameters no group manages yet.
struct Owner {
  std::string path;
  torch::nn::Module* module;
  std::vector<std::pair<std::string, at::Tensor>> params;  // direct parameters
};

// One module's direct parameters that no group manages yet, if any.
std::optional<Owner> unmanaged_owner(const std::string& path, torch::nn::Module& module) {
  Owner owner{path, &module, {}};
  for (const auto& p : module.named_parameters(/*recurse=*/false)) {
    if (!ParamGroup::is_managed(p.value())) owner.params.emplace_back(p.key(), p.value());
  }
  if (owner.params.empty()) return std::nullopt;
  TORCH_CHECK_VALUE(
      dynamic_cast<nn::HookableModule*>(&module) != nullptr,
      "fully_shard: expected every parameter to belong to a hyper_parallel::nn module (Linear, "
      "Embedding, RMSNorm: their forward reads parameters through the hook fully_shard fills), got ",
      path.empty() ? "the root" : path, ".", owner.params[0].first, " of ", module.name());
  return owner;
}

std::vector<Owner> unmanaged_owners(torch::nn::Module& root) {
  std::vector<Owner> out;
  // The root itself by reference: a module on the stack has no shared_ptr to list it by.
  if (auto owner = unmanaged_owner("", root)) out.push_back(std::move(*owner));
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    if (auto owner = unmanaged_owner(item.key(), *item.value())) out.push_back(std::move(*owner));
  }
  return out;
}

at::Tensor cast_input(const at::Tensor& t, const MixedPrecisionPolicy& mp) {
  if (!mp.cast_forward_inputs() || !mp.param_dtype() || !t.defined() ||
      !at::isFloatingType(t.scalar_type())) {
    return t;
  }
  return t.to(*mp.param_dtype());
}

// Starts the gathers of `states` (they travel while this module computes).
void prefetch(const std::vector<std::weak_ptr<State>>& states) {
  for (const auto& w : states) {
    if (auto s = w.lock(); s && s->group) s->group->unshard(/*async_op=*/true);
  }
}

// The hooks of one module whose parameters `state`'s group manages.
void install_hooks(const Owner& owner, const std::shared_ptr<State>& state) {
  auto& hm = dynamic_cast<nn::HookableModule&>(*owner.module);
  TORCH_CHECK_VALUE(!hm.has_parameter_view(), "fully_shard: expected ", owner.path,
                    " to read its own parameters, got a module whose parameters another hook provides");
  std::map<std::string, int64_t> index;
  for (const auto& [name, param] : owner.params) index[name] = state->group->index_of(param);
  // The hooks hold the state: it lives as long as the module's own modules do.
  hm.set_parameter_view([s = state, index](const std::string& name, const at::Tensor& registered) {
    auto it = index.find(name);
    return it == index.end() ? registered : s->group->gathered()[it->second];
  });
  // An embedding's forward reads the rows of its ids (a row-sparse group gathers only those).
  const bool reads_rows_by_id = dynamic_cast<nn::EmbeddingImpl*>(owner.module) != nullptr;
  hm.add_input_hook([s = state, reads_rows_by_id](std::vector<at::Tensor> inputs) {
    for (auto& t : inputs) t = dtensor::DTensor::carry_tag(t, cast_input(t, s->mp_policy));
    s->group->pre_forward(reads_rows_by_id && !inputs.empty() ? inputs[0] : at::Tensor(),
                          [&s] { prefetch(s->forward_prefetch); });
    return inputs;
  });
  hm.add_output_hook([s = state](std::vector<at::Tensor> outputs) {
    auto backward_prefetch = s->backward_prefetch;
    outputs = s->group->register_pre_backward(std::move(outputs),
                                              [backward_prefetch] { prefetch(backward_prefetch); });
    s->group->post_forward();
    return outputs;
  });
  hm.add_applied_style("fully_shard");
}

template <typename Fn>
void for_each_state(const std::shared_ptr<State>& state, bool recurse, Fn&& fn) {
  fn(*state);
  if (!recurse) return;
  for (const auto& b : state->below) for_each_state(b, true, fn);
}

// A new state for `module` (refused if fully_shard was applied to it), with the states below it.
std::shared_ptr<State> new_state(torch::nn::Module& module, const FullyShardOptions& options,
                                 const std::string& where) {
  TORCH_CHECK_VALUE(state_of(module) == nullptr,
                    "fully_shard: expected a module fully_shard was not applied to, got ", module.name(),
                    where, " again");
  auto state = std::make_shared<State>();
  try {
    state->module = module.shared_from_this();
    state->owned = true;
  } catch (const std::bad_weak_ptr&) {  // a module on the stack: known by its address and children
    for (const auto& child : module.children()) state->children.push_back(child);
  }
  state->mp_policy = options.mp_policy();
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    if (auto below = state_of(*item.value()); below) state->below.push_back(below);
  }
  return state;
}

// One group of the parameters of `owners` (owners[i] under states[i]'s module) and their hooks.
void make_group(const std::vector<std::vector<Owner>>& owners,
                const std::vector<std::shared_ptr<State>>& states, const FullyShardOptions& options) {
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  const Owner* alone = nullptr;
  size_t count = 0;
  for (const auto& of_module : owners) {
    for (const auto& owner : of_module) {
      alone = &owner;
      ++count;
      for (const auto& [name, param] : owner.params) {
        params.push_back(param);
        names.push_back(owner.path.empty() ? name : owner.path + "." + name);
      }
    }
  }
  if (params.empty()) return;
  auto group = std::make_shared<ParamGroup>(std::move(params), std::move(names), options);
  // Each owner's call is a user: the pass ends once each has run (also across a list's modules).
  group->set_users(static_cast<int64_t>(count));
  // An embedding's gradient is the rows of the tokens the step saw: those travel, not the rest.
  const bool embedding_alone =
      count == 1 && alone->params.size() == 1 && dynamic_cast<nn::EmbeddingImpl*>(alone->module) != nullptr;
  if (options.row_sparse_embeddings() && embedding_alone) group->set_row_sparse_gradients(true);
  for (const auto& state : states) state->group = group;
  for (size_t i = 0; i < owners.size(); ++i) {
    for (const auto& owner : owners[i]) install_hooks(owner, states[i]);
  }
}

void register_state(torch::nn::Module& module, const std::shared_ptr<State>& state) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.by_module.insert_or_assign(&module, Registry::Entry{state, state->group ? nullptr : state});
}

// This call is the root of the groups below it (until a call above it): one prefetch order.
void share_pass_order(const std::shared_ptr<State>& state) {
  std::vector<ParamGroup*> groups;
  for_each_state(state, true, [&](State& s) { groups.push_back(s.group.get()); });
  ParamGroup::share_pass_order(groups);
}

// The modules of a list that no other one of it contains, each once.
std::vector<torch::nn::Module*> roots_of(const std::vector<torch::nn::Module*>& modules) {
  TORCH_CHECK_VALUE(!modules.empty(), "fully_shard: expected a non-empty list of modules, got an empty one");
  std::vector<std::vector<const torch::nn::Module*>> inside(modules.size());
  for (size_t i = 0; i < modules.size(); ++i) {
    TORCH_CHECK_VALUE(modules[i] != nullptr, "fully_shard: expected a module at index ", i,
                      " of the list, got nullptr");
    for (const auto& sub : modules[i]->modules(/*include_self=*/false)) inside[i].push_back(sub.get());
  }
  std::vector<torch::nn::Module*> roots;
  for (auto* m : modules) {
    bool below = false;
    for (const auto& in : inside) below = below || std::find(in.begin(), in.end(), m) != in.end();
    if (!below && std::find(roots.begin(), roots.end(), m) == roots.end()) roots.push_back(m);
  }
  return roots;
}

}  // namespace

FSDPModule fully_shard(torch::nn::Module& module, const FullyShardOptions& options) {
  auto state = new_state(module, options, "");
  make_group({unmanaged_owners(module)}, {state}, options);
  register_state(module, state);
  share_pass_order(state);
  return FSDPModule(state);
}

std::vector<FSDPModule> fully_shard(const std::vector<torch::nn::Module*>& modules,
                                    const FullyShardOptions& options) {
  const auto roots = roots_of(modules);
  std::vector<std::shared_ptr<State>> states;
  std::vector<std::vector<Owner>> owners;
  for (auto* m : roots) {
    const auto at = std::find(modules.begin(), modules.end(), m) - modules.begin();
    states.push_back(new_state(*m, options, " at index " + std::to_string(at) + " of the list"));
  }
  // A module two of them hold (registered in both) is an owner once.
  std::vector<const torch::nn::Module*> seen;
  for (size_t i = 0; i < roots.size(); ++i) {
    owners.emplace_back();
    for (auto& owner : unmanaged_owners(*roots[i])) {
      if (std::find(seen.begin(), seen.end(), owner.module) != seen.end()) continue;
      seen.push_back(owner.module);
      if (roots.size() > 1) owner.path = std::to_string(i) + (owner.path.empty() ? "" : "." + owner.path);
      owners.back().push_back(std::move(owner));
    }
  }
  make_group(owners, states, options);
  std::vector<FSDPModule> handles;
  for (size_t i = 0; i < roots.size(); ++i) {
    register_state(*roots[i], states[i]);
    handles.push_back(FSDPModule(states[i]));
  }
  for (const auto& state : states) share_pass_order(state);
  return handles;
}

std::optional<FSDPModule> FSDPModule::of(torch::nn::Module& module) {
  auto state = state_of(module);
  if (!state) return std::nullopt;
  return FSDPModule(state);
}

void FSDPModule::unshard(bool async_op) const {
  if (state_->group) state_->group->unshard(async_op);
}

void FSDPModule::wait_for_unshard() const {
  if (state_->group) state_->group->wait_for_unshard();
}

void FSDPModule::reshard() const {
  if (state_->group) state_->group->reshard();
}

void FSDPModule::set_requires_gradient_sync(bool sync, bool recurse) const {
  for_each_state(state_, recurse, [&](State& s) {
    if (s.group) s.group->set_requires_gradient_sync(sync);
  });
}

void FSDPModule::set_requires_all_reduce(bool all_reduce, bool recurse) const {
  for_each_state(state_, recurse, [&](State& s) {
    if (s.group) s.group->set_requires_all_reduce(all_reduce);
  });
}

void FSDPModule::set_reshard_after_forward(bool reshard, bool recurse) const {
  for_each_state(state_, recurse, [&](State& s) {
    if (s.group) s.group->set_reshard_after_forward(reshard);
  });
}

void FSDPModule::set_reshard_after_backward(bool reshard, bool recurse) const {
  for_each_state(state_, recurse, [&](State& s) {
    if (s.group) s.group->set_reshard_after_backward(reshard);
  });
}

void FSDPModule::set_gradient_scaling_factor(double factor) const {
  if (state_->group) state_->group->set_gradient_scaling_factor(factor);
}

void FSDPModule::set_reduce_op(comm::ReduceOp op) const {
  if (state_->group) state_->group->set_reduce_op(op);
}

void FSDPModule::set_gradient_divide_factor(double factor) const {
  if (state_->group) {
    state_->group->set_gradient_divide_factor(factor);
  } else {
    ParamGroup::check_gradient_divide_factor(factor);
  }
}

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) const {
  state_->forward_prefetch.clear();
  for (const auto& m : modules) state_->forward_prefetch.push_back(m.state_);
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) const {
  state_->backward_prefetch.clear();
  for (const auto& m : modules) state_->backward_prefetch.push_back(m.state_);
}

void FSDPModule::zero_grad() const {
  for_each_state(state_, true, [](State& s) {
    if (!s.group) return;
    for (const auto& p : s.group->parameters()) {
      p.mutable_grad() = at::Tensor();
      if (nn::main_grad(p).defined()) nn::set_main_grad(p, {});
    }
  });
}

ParamGroup* FSDPModule::group() const { return state_->group.get(); }

}  // namespace hyper_parallel::fully_shard
