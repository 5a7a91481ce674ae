#include <hyper_parallel/core/tensor_parallel/parallelize.h>

#include <fnmatch.h>

#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/counters.h>

#include "style_common.h"

namespace hyper_parallel::tensor_parallel {
namespace {

std::vector<std::string> split_path(const std::string& key) {
  std::vector<std::string> tokens;
  std::stringstream s(key);
  std::string token;
  while (std::getline(s, token, '.')) tokens.push_back(token);
  return tokens;
}

// One module a plan key matched, with its path and the style it gets.
struct Target {
  std::string fqn;
  torch::nn::Module* module;
  const ParallelStyle* style;
};

// Appends every module below `module` whose path matches tokens[depth..]; returns how many.
int collect_matching(torch::nn::Module& module, const std::string& fqn,
                     const std::vector<std::string>& tokens, size_t depth, const ParallelStyle& style,
                     std::vector<Target>& out) {
  if (depth == tokens.size()) {
    out.push_back({fqn, &module, &style});
    return 1;
  }
  int matched = 0;
  for (const auto& child : module.named_children()) {
    if (fnmatch(tokens[depth].c_str(), child.key().c_str(), 0) == 0) {
      matched += collect_matching(*child.value(), fqn.empty() ? child.key() : fqn + "." + child.key(),
                                  tokens, depth + 1, style, out);
    }
  }
  return matched;
}

// One line per target: "fqn: Style weight Float[1024, 256] bias Float[1024]".
std::vector<std::string> describe(const std::vector<Target>& targets) {
  std::vector<std::string> lines;
  for (const auto& t : targets) {
    std::ostringstream line;
    line << (t.fqn.empty() ? "(root)" : t.fqn) << ": " << t.style->name();
    for (const auto& p : t.module->named_parameters(/*recurse=*/false)) {
      line << " " << p.key() << " " << p.value().scalar_type() << p.value().sizes();
    }
    lines.push_back(line.str());
  }
  return lines;
}

}  // namespace

namespace detail {

void check_plan_agrees(const std::vector<std::string>& lines, const dtensor::DeviceMesh& mesh) {
  if (mesh.size(0) == 1) return;
  comm::CommRegion region("parallelize_check");
  const auto group = mesh.get_group(0);
  std::string text;
  for (const auto& l : lines) text += l + "\n";
  auto bytes = at::tensor(std::vector<int32_t>(text.begin(), text.end()), at::kInt);
  auto lengths = comm::all_gather(at::full({1}, bytes.numel(), at::kLong), 0, group);
  std::vector<int64_t> sizes(lengths.data_ptr<int64_t>(), lengths.data_ptr<int64_t>() + lengths.numel());
  const auto all = comm::all_gather(bytes, 0, group, sizes);
  std::vector<std::vector<std::string>> per_rank;
  int64_t at = 0;
  bool same = true;
  for (auto n : sizes) {
    auto chars = all.narrow(0, at, n);
    std::string other(chars.data_ptr<int32_t>(), chars.data_ptr<int32_t>() + n);
    at += n;
    same = same && other == text;
    std::vector<std::string> rank_lines;
    std::stringstream s(other);
    for (std::string l; std::getline(s, l);) rank_lines.push_back(l);
    per_rank.push_back(std::move(rank_lines));
  }
  if (same) return;
  size_t first = 0;
  for (;; ++first) {
    bool differ = false;
    for (const auto& r : per_rank) {
      differ = differ || first >= r.size() || first >= per_rank[0].size() || r[first] != per_rank[0][first];
    }
    if (differ) break;
  }
  std::ostringstream ranks;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    ranks << (r ? "; " : "") << "rank " << r << " (global " << group.global_ranks()[r] << ") has "
          << (first < per_rank[r].size() ? per_rank[r][first] : "nothing more to parallelize");
  }
  TORCH_CHECK_VALUE(false, "parallelize_module: ranks of ", group.name(),
                    " disagree on what they parallelize (global shapes, dtypes, styles): ", ranks.str(),
                    ". Every rank must build the same model and pass the same plan");
}

}  // namespace detail

void check_tp_mesh(const char* where, const dtensor::DeviceMesh& mesh) {
  TORCH_CHECK_VALUE(mesh.ndim() == 1, where, ": expected a 1-d TP mesh, got a ", mesh.ndim(),
                    "-d mesh ", mesh.str(), "; slice it by name, e.g. mesh[\"tp\"]");
}

void parallelize_module(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                        const ParallelStyle& style, std::optional<int64_t> src_data_rank) {
  check_tp_mesh("parallelize_module", mesh);
  detail::check_plan_agrees(describe({{"", &module, &style}}), mesh);
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
  std::vector<Target> targets;
  for (const auto& [key, style] : plan) {
    TORCH_CHECK(style != nullptr, "parallelize_module: expected a style for plan key '", key,
                "', got nullptr");
    if (key.empty()) {
      targets.push_back({"", &module, style.get()});
      continue;
    }
    const auto tokens = split_path(key);
    for (const auto& t : tokens) {
      TORCH_CHECK(!t.empty(), "parallelize_module: expected plan key tokens separated by single "
                  "dots, got '", key, "'");
    }
    if (collect_matching(module, "", tokens, 0, *style, targets) == 0) {
      TORCH_WARN("parallelize_module: plan key '", key, "' (", style->name(),
                 ") matched no submodule of ", module.name());
    }
  }
  detail::check_plan_agrees(describe(targets), mesh);
  for (const auto& t : targets) {
    try {
      t.style->apply(*t.module, mesh, src_data_rank);
    } catch (c10::Error& e) {
      // Name the module; the error keeps its type (and so its Python exception class).
      e.add_context("while applying " + t.style->name() + " to " + (t.fqn.empty() ? "the root module" : t.fqn));
      throw;
    }
  }
}

}  // namespace hyper_parallel::tensor_parallel
