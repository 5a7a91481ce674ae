#pragma once
// The rules of a parallelize plan that do not depend on the kind of module tree: which module
// paths a plan key matches, how a target is described, and the ranks' agreement on the targets.
// parallelize_module applies them to this library's modules; the Python front end to torch.nn
// modules, so both follow one rule set.

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include <hyper_parallel/core/dtensor/device_mesh.h>

namespace hyper_parallel::tensor_parallel {

/// A plan key split into its path tokens; "" (the root) has none. An empty token (e.g.
/// "layers..w1") is a c10::ValueError naming the key.
std::vector<std::string> plan_key_tokens(const std::string& key);

/// Whether module path `fqn` ("layers.0.attention.wq"; "" is the root) matches the key's tokens,
/// each glob-matched (*, ?, [1-2]) against the path token at its depth.
bool plan_key_matches(const std::vector<std::string>& tokens, const std::string& fqn);

/// One plan entry: a key and the name of its style (for messages).
struct PlanEntry {
  std::string key;
  std::string style;
};
/// A module an entry matched.
struct PlanTarget {
  size_t entry;     ///< index into the plan
  std::string fqn;  ///< the module's path ("" for the root)
};

/// Matches each entry, in plan order, against `module_paths` (the path of every module of the
/// tree, root "" first, in pre-order: the order a depth-first walk visits them). A key that
/// matches nothing, and an empty plan, are reported with a warning (TORCH_WARN) naming
/// `root_name`: never silently ignored.
std::vector<PlanTarget> match_plan(const std::vector<PlanEntry>& plan,
                                   const std::vector<std::string>& module_paths,
                                   const std::string& root_name);

/// A module's own parameter, as the agreement check describes it.
struct ParameterDescription {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};
/// "fqn: Style weight Float[1024, 256] bias Float[1024]" ("(root)" for the root's path "").
std::string describe_target(const std::string& fqn, const std::string& style,
                            const std::vector<ParameterDescription>& parameters);

/// parallelize_module's apply-time check: every rank of the 1-d TP mesh passes the descriptions
/// of what it will parallelize, one line per target; ranks whose lines differ all throw a
/// c10::ValueError naming the first line that differs and each rank's version of it, before
/// anything is sharded. Collective over the mesh.
void check_plan_agrees(const std::vector<std::string>& lines, const dtensor::DeviceMesh& mesh);

}  // namespace hyper_parallel::tensor_parallel
