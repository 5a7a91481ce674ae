#include <hyper_parallel/core/tensor_parallel/plan.h>

#include <fnmatch.h>

#include <sstream>

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/counters.h>

namespace hyper_parallel::tensor_parallel {
namespace {

std::vector<std::string> split_on_dots(const std::string& text) {
  std::vector<std::string> tokens;
  if (text.empty()) return tokens;
  std::stringstream s(text);
  std::string token;
  while (std::getline(s, token, '.')) tokens.push_back(token);
  if (text.back() == '.') tokens.emplace_back();
  return tokens;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::stringstream s(text);
  for (std::string l; std::getline(s, l);) lines.push_back(l);
  return lines;
}

// The first line index at which the ranks' descriptions differ.
size_t first_difference(const std::vector<std::vector<std::string>>& per_rank) {
  for (size_t i = 0;; ++i) {
    for (const auto& lines : per_rank) {
      if (i >= lines.size() || i >= per_rank[0].size() || lines[i] != per_rank[0][i]) return i;
    }
  }
}

}  // namespace

std::vector<std::string> plan_key_tokens(const std::string& key) {
  auto tokens = split_on_dots(key);
  for (const auto& t : tokens) {
    TORCH_CHECK_VALUE(!t.empty(),
                      "parallelize_module: expected plan key tokens separated by single "
                      "dots, got '",
                      key, "'");
  }
  return tokens;
}

bool plan_key_matches(const std::vector<std::string>& tokens, const std::string& fqn) {
  const auto path = split_on_dots(fqn);
  if (path.size() != tokens.size()) return false;
  for (size_t i = 0; i < path.size(); ++i) {
    if (fnmatch(tokens[i].c_str(), path[i].c_str(), 0) != 0) return false;
  }
  return true;
}

std::vector<PlanTarget> match_plan(const std::vector<PlanEntry>& plan,
                                   const std::vector<std::string>& module_paths,
                                   const std::string& root_name) {
  if (plan.empty()) {
    TORCH_WARN("parallelize_module: the plan is empty; nothing in ", root_name, " is parallelized");
    return {};
  }
  std::vector<PlanTarget> targets;
  for (size_t e = 0; e < plan.size(); ++e) {
    const auto tokens = plan_key_tokens(plan[e].key);
    const size_t before = targets.size();
    for (const auto& fqn : module_paths) {
      if (plan_key_matches(tokens, fqn)) targets.push_back({e, fqn});
    }
    if (targets.size() == before) {
      TORCH_WARN("parallelize_module: plan key '", plan[e].key, "' (", plan[e].style,
                 ") matched no submodule of ", root_name);
    }
  }
  return targets;
}

std::string describe_target(const std::string& fqn, const std::string& style,
                            const std::vector<ParameterDescription>& parameters) {
  std::ostringstream line;
  line << (fqn.empty() ? "(root)" : fqn) << ": " << style;
  for (const auto& p : parameters) line << " " << p.name << " " << p.dtype << c10::IntArrayRef(p.shape);
  return line.str();
}

void check_plan_agrees(const std::vector<std::string>& lines, const dtensor::DeviceMesh& mesh) {
  if (mesh.size(0) == 1) return;
  comm::CommRegion region("parallelize_check");
  const auto group = mesh.get_group(0);
  std::string text;
  for (const auto& l : lines) text += l + "\n";
  std::vector<std::vector<std::string>> per_rank;
  bool same = true;
  for (const auto& other : comm::all_gather_strings(text, group)) {
    same = same && other == text;
    per_rank.push_back(lines_of(other));
  }
  if (same) return;
  const size_t first = first_difference(per_rank);
  std::ostringstream ranks;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    ranks << (r ? "; " : "") << "rank " << r << " (global " << group.global_ranks()[r] << ") has "
          << (first < per_rank[r].size() ? per_rank[r][first] : "nothing more to parallelize");
  }
  TORCH_CHECK_VALUE(false, "parallelize_module: ranks of ", group.name(),
                    " disagree on what they parallelize (global shapes, dtypes, styles): ", ranks.str(),
                    ". Every rank must build the same model and pass the same plan");
}

}  // namespace hyper_parallel::tensor_parallel
