#include <hyper_parallel/checkpoint/checkpoint.h>

#include <unordered_map>

#include <ATen/ATen.h>
#include <c10/util/C++17.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>

#include <hyper_parallel/core/nn/parameter_layout.h>

#include "layout.h"
#include "safetensors.h"

namespace hyper_parallel::checkpoint {

Entry Entry::replicated(at::Tensor tensor) {
  Entry e;
  e.global_shape = tensor.sizes().vec();
  e.local = std::move(tensor);
  return e;
}

bool Entry::is_replicated() const {
  if (!mesh) return true;
  for (const auto& p : placements) {
    if (!p.is_replicate()) return false;
  }
  return true;
}

void State::add(std::string key, Entry entry) {
  TORCH_CHECK(!key.empty(), "State::add: expected a non-empty key");
  TORCH_CHECK(!contains(key), "State::add: expected a new key, got '", key, "' twice");
  TORCH_CHECK(entry.local.defined(), "State::add: ", key, ": expected a defined tensor");
  detail::dtype_name("State::add", entry.local.scalar_type(), key);
  const auto region = detail::local_region("State::add", key, entry);
  TORCH_CHECK(region.shape == entry.local.sizes().vec(), "State::add: ", key,
              ": expected a local tensor of shape ", detail::shape_str(region.shape),
              " (what its layout gives this rank of global shape ", detail::shape_str(entry.global_shape),
              "), got ", entry.local.sizes());
  index_.emplace(key, items_.size());
  items_.emplace_back(std::move(key), std::move(entry));
}

const Entry* State::find(const std::string& key) const {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &items_[it->second].second;
}

Entry* State::find(const std::string& key) {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : &items_[it->second].second;
}

const Entry& State::at(const std::string& key) const {
  const auto* e = find(key);
  TORCH_CHECK(e != nullptr, "State::at: expected a key of the state, got '", key, "'");
  return *e;
}

Entry& State::at(const std::string& key) {
  auto* e = find(key);
  TORCH_CHECK(e != nullptr, "State::at: expected a key of the state, got '", key, "'");
  return *e;
}

bool State::erase(const std::string& key) {
  auto it = index_.find(key);
  if (it == index_.end()) return false;
  items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(it->second));
  index_.clear();
  for (size_t i = 0; i < items_.size(); ++i) index_.emplace(items_[i].first, i);
  return true;
}

namespace {

struct NamedParameter {
  std::string fqn;
  at::Tensor tensor;
};

// Parameters by FQN, and buffers, in module order (as grad_utils walks them).
void walk(torch::nn::Module& model, std::vector<NamedParameter>* params,
          std::vector<std::pair<std::string, at::Tensor>>* buffers) {
  for (const auto& item : model.named_modules()) {
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      if (p.value().defined()) params->push_back({prefix + p.key(), p.value()});
    }
    if (buffers == nullptr) continue;
    for (const auto& b : item.value()->named_buffers(/*recurse=*/false)) {
      if (b.value().defined()) buffers->emplace_back(prefix + b.key(), b.value());
    }
  }
}

// An entry aliasing `local`, laid out as `param` (whose shard it mirrors) was.
Entry entry_like(at::Tensor local, const at::Tensor& param) {
  const auto layout = nn::recorded_layout(param);
  if (!layout) return Entry::replicated(std::move(local));
  Entry e;
  e.local = std::move(local);
  e.global_shape = layout->global_shape;
  e.mesh = layout->mesh;
  e.placements = layout->placements;
  return e;
}

// libtorch's AdamW state of `param`, created as AdamW::step would on its first step (zeros, step
// 0) if it has none yet, so that a load has tensors to fill.
torch::optim::AdamWParamState& adamw_state_of(torch::optim::AdamW& optimizer, const at::Tensor& param,
                                              bool amsgrad) {
  // libtorch keys AdamW's state by the parameter's TensorImpl address, as AdamW::step does.
  const std::string impl_key = c10::guts::to_string(param.unsafeGetTensorImpl());
  auto& states = optimizer.state();
  if (states.find(impl_key) == states.end()) {
    auto fresh = std::make_unique<torch::optim::AdamWParamState>();
    fresh->step(0);
    fresh->exp_avg(at::zeros_like(param, at::MemoryFormat::Preserve));
    fresh->exp_avg_sq(at::zeros_like(param, at::MemoryFormat::Preserve));
    if (amsgrad) fresh->max_exp_avg_sq(at::zeros_like(param, at::MemoryFormat::Preserve));
    states[impl_key] = std::move(fresh);
  }
  auto* s = dynamic_cast<torch::optim::AdamWParamState*>(states[impl_key].get());
  TORCH_INTERNAL_ASSERT(s != nullptr, "add_optimizer_state: the optimizer's state is not AdamW's");
  return *s;
}

}  // namespace

Entry entry_of(const at::Tensor& tensor) { return entry_like(tensor, tensor); }

State model_state(torch::nn::Module& model) {
  std::vector<NamedParameter> params;
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  walk(model, &params, &buffers);
  State state;
  for (auto& p : params) state.add(p.fqn, entry_of(p.tensor));
  for (auto& [fqn, b] : buffers) state.add(fqn, Entry::replicated(b));
  return state;
}

void add_adamw_state(State& state, const std::string& fqn, const at::Tensor& param,
                     const AdamWTensors& adamw) {
  const std::string prefix = "optim." + fqn + ".";
  state.add(prefix + "exp_avg", entry_like(adamw.exp_avg, param));
  state.add(prefix + "exp_avg_sq", entry_like(adamw.exp_avg_sq, param));
  if (adamw.max_exp_avg_sq.defined())
    state.add(prefix + "max_exp_avg_sq", entry_like(adamw.max_exp_avg_sq, param));
  // The step count lives where the optimizer keeps it: copied out at save, back in at load.
  Entry step = Entry::replicated(at::full({1}, adamw.get_step(), at::kLong));
  step.before_save = [get = adamw.get_step](const at::Tensor& local) { local.fill_(get()); };
  step.after_load = [set = adamw.set_step](const at::Tensor& local) { set(local.item<int64_t>()); };
  state.add(prefix + "step", std::move(step));
}

void add_optimizer_state(State& state, torch::optim::AdamW& optimizer, torch::nn::Module& model) {
  std::vector<NamedParameter> params;
  walk(model, &params, nullptr);
  std::unordered_map<const c10::TensorImpl*, const NamedParameter*> by_impl;
  for (const auto& p : params) by_impl.emplace(p.tensor.unsafeGetTensorImpl(), &p);
  for (auto& group : optimizer.param_groups()) {
    const auto& options = static_cast<const torch::optim::AdamWOptions&>(group.options());
    for (const auto& param : group.params()) {
      auto it = by_impl.find(param.unsafeGetTensorImpl());
      TORCH_CHECK(it != by_impl.end(), "add_optimizer_state: expected every parameter of the ",
                  "optimizer to belong to the model, got one of shape ", param.sizes(), " that does not");
      auto& s = adamw_state_of(optimizer, param, options.amsgrad());
      // Looked up by key each time, so that the step follows a state the optimizer replaced.
      auto* opt = &optimizer;
      auto lookup = [opt, impl_key = c10::guts::to_string(param.unsafeGetTensorImpl()),
                     fqn = it->second->fqn]() -> torch::optim::AdamWParamState& {
        auto found = opt->state().find(impl_key);
        TORCH_CHECK(found != opt->state().end(), "add_optimizer_state: ", fqn,
                    ": the optimizer no longer has state for this parameter");
        return static_cast<torch::optim::AdamWParamState&>(*found->second);
      };
      add_adamw_state(state, it->second->fqn, param,
                      {s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq(), [lookup] { return lookup().step(); },
                       [lookup](int64_t step) { lookup().step(step); }});
    }
  }
}

}  // namespace hyper_parallel::checkpoint
