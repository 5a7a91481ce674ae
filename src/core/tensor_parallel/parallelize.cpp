#include <hyper_parallel/core/tensor_parallel/parallelize.h>

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <hyper_parallel/core/tensor_parallel/mc2/linear.h>
#include <hyper_parallel/core/tensor_parallel/plan.h>

namespace hyper_parallel::tensor_parallel {
namespace {

// Every module of the tree with its path, root ("") first, in pre-order.
void walk(torch::nn::Module& module, const std::string& fqn,
          std::vector<std::pair<std::string, torch::nn::Module*>>& out) {
  out.emplace_back(fqn, &module);
  for (const auto& child : module.named_children()) {
    walk(*child.value(), fqn.empty() ? child.key() : fqn + "." + child.key(), out);
  }
}

// One module a plan key matched, with its path and the style it gets.
struct Target {
  std::string fqn;
  torch::nn::Module* module;
  const ParallelStyle* style;
};

std::vector<std::string> describe(const std::vector<Target>& targets) {
  std::vector<std::string> lines;
  for (const auto& t : targets) {
    std::vector<ParameterDescription> params;
    for (const auto& p : t.module->named_parameters(/*recurse=*/false)) {
      params.push_back({p.key(), p.value().scalar_type(), p.value().sizes().vec()});
    }
    lines.push_back(describe_target(t.fqn, t.style->name(), params));
  }
  return lines;
}

void apply_all(const std::vector<Target>& targets, const dtensor::DeviceMesh& mesh,
               std::optional<int64_t> src_data_rank) {
  check_plan_agrees(describe(targets), mesh);
  for (const auto& t : targets) {
    try {
      t.style->apply(*t.module, mesh, src_data_rank);
      // An MC2 layer's errors at forward name it by its path.
      if (auto mc2 = MC2Linear::of(*t.module)) mc2->set_label(t.fqn.empty() ? "the root module" : t.fqn);
    } catch (c10::Error& e) {
      // Name the module; the error keeps its type (and so its Python exception class).
      e.add_context("while applying " + t.style->name() + " to " +
                    (t.fqn.empty() ? "the root module" : t.fqn));
      throw;
    }
  }
}

}  // namespace

void check_tp_mesh(const char* where, const dtensor::DeviceMesh& mesh) {
  TORCH_CHECK_VALUE(mesh.ndim() == 1, where, ": expected a 1-d TP mesh, got a ", mesh.ndim(), "-d mesh ",
                    mesh.str(), "; slice it by name, e.g. mesh[\"tp\"]");
}

void parallelize_module(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                        const ParallelStyle& style, std::optional<int64_t> src_data_rank) {
  check_tp_mesh("parallelize_module", mesh);
  apply_all({{"", &module, &style}}, mesh, src_data_rank);
}

void parallelize_module(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                        const ParallelizePlan& plan, std::optional<int64_t> src_data_rank) {
  check_tp_mesh("parallelize_module", mesh);
  std::vector<PlanEntry> entries;
  for (const auto& [key, style] : plan) {
    TORCH_CHECK(style != nullptr, "parallelize_module: expected a style for plan key '", key,
                "', got nullptr");
    entries.push_back({key, style->name()});
  }
  std::vector<std::pair<std::string, torch::nn::Module*>> modules;
  walk(module, "", modules);
  std::vector<std::string> paths;
  paths.reserve(modules.size());
  for (const auto& m : modules) paths.push_back(m.first);
  std::vector<Target> targets;
  for (const auto& t : match_plan(entries, paths, module.name())) {
    const auto it =
        std::find_if(modules.begin(), modules.end(), [&](const auto& m) { return m.first == t.fqn; });
    targets.push_back({t.fqn, it->second, plan[t.entry].second.get()});
  }
  if (plan.empty()) return;
  apply_all(targets, mesh, src_data_rank);
}

}  // namespace hyper_parallel::tensor_parallel
