#include <hyper_parallel/core/nn/hookable_module.h>

#include <map>
#include <ostream>

#include <torch/nn/module.h>

namespace hyper_parallel::nn {
namespace {

// "Shard(0) over tp[2]", one entry per mesh dim.
void print_layout(std::ostream& stream, const ParameterLayout& layout) {
  const auto& names = layout.mesh.dim_names();
  for (size_t i = 0; i < layout.placements.size(); ++i) {
    stream << (i ? " x " : "") << layout.placements[i].str() << " over "
           << (i < names.size() ? names[i] : "dim" + std::to_string(i)) << "["
           << layout.mesh.size(static_cast<int64_t>(i)) << "]";
  }
}

// The module's own parameters by name, in name order. Every HookableModule is a torch::nn::Module
// too (the hooks are a mixin of this library's modules and the examples').
std::map<std::string, at::Tensor> own_parameters(const HookableModule& hookable) {
  std::map<std::string, at::Tensor> out;
  if (const auto* module = dynamic_cast<const torch::nn::Module*>(&hookable)) {
    for (const auto& item : module->named_parameters(/*recurse=*/false))
      out.emplace(item.key(), item.value());
  }
  return out;
}

}  // namespace

std::optional<ParameterLayout> HookableModule::parameter_layout(const std::string& name) const {
  const auto params = own_parameters(*this);
  auto it = params.find(name);
  return it == params.end() ? std::nullopt : recorded_layout(it->second);
}

void HookableModule::print_parallel_state(std::ostream& stream) const {
  if (!styles_.empty()) {
    stream << ", style=";
    for (size_t i = 0; i < styles_.size(); ++i) stream << (i ? "+" : "") << styles_[i];
  }
  for (const auto& [name, param] : own_parameters(*this)) {
    if (auto layout = recorded_layout(param)) {
      stream << ", " << name << "=";
      print_layout(stream, *layout);
    }
  }
  if (kernel_) stream << ", forward=" << kernel_->name();
}

}  // namespace hyper_parallel::nn
