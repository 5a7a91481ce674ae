#include <hyper_parallel/core/nn/hookable_module.h>

#include <ostream>

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

}  // namespace

void HookableModule::print_parallel_state(std::ostream& stream) const {
  if (!styles_.empty()) {
    stream << ", style=";
    for (size_t i = 0; i < styles_.size(); ++i) stream << (i ? "+" : "") << styles_[i];
  }
  for (const auto& [name, layout] : layouts_) {
    stream << ", " << name << "=";
    print_layout(stream, layout);
  }
  if (kernel_) stream << ", forward=" << kernel_->name();
}

}  // namespace hyper_parallel::nn
