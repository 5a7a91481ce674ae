#include <hyper_parallel/core/tensor_parallel/parallelize.h>

#include <fnmatch.h>

#include <sstream>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

namespace hyper_parallel::tensor_parallel {
namespace {

std::vector<std::string> split_path(const std::string& key) {
  std::vector<std::string> tokens;
  std::stringstream s(key);
  std::string token;
  while (std::getline(s, token, '.')) tokens.push_back(token);
  return tokens;
}

// Applies `style` to every module below `module` whose path matches tokens[depth..]; returns how
// many matched.
int apply_matching(torch::nn::Module& module, const std::vector<std::string>& tokens, size_t depth,
                   const dtensor::DeviceMesh& mesh, const ParallelStyle& style,
                   std::optional<int64_t> src_data_rank) {
  if (depth == tokens.size()) {
    style.apply(module, mesh, src_data_rank);
    return 1;
  }
  int matched = 0;
  for (const auto& child : module.named_children()) {
    if (fnmatch(tokens[depth].c_str(), child.key().c_str(), 0) == 0) {
      matched += apply_matching(*child.value(), tokens, depth + 1, mesh, style, src_data_rank);
    }
  }
  return matched;
}

}  // namespace

void check_tp_mesh(const char* where, const dtensor::DeviceMesh& mesh) {
  TORCH_CHECK(mesh.ndim() == 1, where, ": expected a 1-d TP mesh, got a ", mesh.ndim(), "-d mesh ",
              mesh.str(), "; slice it by name, e.g. mesh[\"tp\"]");
}

void parallelize_module(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                        const ParallelStyle& style, std::optional<int64_t> src_data_rank) {
  check_tp_mesh("parallelize_module", mesh);
  style.apply(module, mesh, src_data_rank);
}

void parallelize_module(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                        const ParallelizePlan& plan, std::optional<int64_t> src_data_rank) {
  check_tp_mesh("parallelize_module", mesh);
  if (plan.empty()) {
    TORCH_WARN("parallelize_module: the plan is empty; nothing in ", module.name(),
               " is parallelized");
    return;
  }
  for (const auto& [key, style] : plan) {
    TORCH_CHECK(style != nullptr, "parallelize_module: expected a style for plan key '", key,
                "', got nullptr");
    if (key.empty()) {
      style->apply(module, mesh, src_data_rank);
      continue;
    }
    const auto tokens = split_path(key);
    for (const auto& t : tokens) {
      TORCH_CHECK(!t.empty(), "parallelize_module: expected plan key tokens separated by single "
                  "dots, got '", key, "'");
    }
    if (apply_matching(module, tokens, 0, mesh, *style, src_data_rank) == 0) {
      TORCH_WARN("parallelize_module: plan key '", key, "' (", style->name(),
                 ") matched no submodule of ", module.name());
    }
  }
}

}  // namespace hyper_parallel::tensor_parallel
