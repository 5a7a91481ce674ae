#pragma once
// Internal (tagged.cpp): what an op does to the last dim of a tensor, read from its backward
// node; DTensor::trace_back walks through the ops that keep it.

#include <string>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/generated/Functions.h>

#include "../autograd/attach_backward.h"

namespace hyper_parallel::dtensor {

// What an op does to a tensor's layout on its last dim, read from its backward node: keeps it
// (views and row selection that leave the last dim whole, casts, elementwise arithmetic), starts a
// new one (a matmul, another DTensor's node: what comes before is another tensor's layout), or
// may mix it (anything else: a softmax, a flip, a slice of the last dim).
enum class LastDim { kKept, kNew, kMixed };

inline LastDim last_dim_after(const torch::autograd::Node& node) {
  namespace gen = torch::autograd::generated;
  if (const auto* slice = dynamic_cast<const gen::SliceBackward0*>(&node))
    return slice->dim == static_cast<int64_t>(slice->self_sym_sizes.size()) - 1 ? LastDim::kMixed
                                                                                : LastDim::kKept;
  if (const auto* select = dynamic_cast<const gen::SelectBackward0*>(&node))
    return select->dim == static_cast<int64_t>(select->self_sizes.size()) - 1 ? LastDim::kMixed
                                                                              : LastDim::kKept;
  if (const auto* index = dynamic_cast<const gen::IndexBackward0*>(&node))
    return index->indices_.size() >= index->self_sizes.size() ? LastDim::kMixed : LastDim::kKept;
  if (detail::made_by_attach_backward(node))
    return detail::is_identity(node) ? LastDim::kKept : LastDim::kNew;
  static const char* const kKeeps[] = {
      "View",   "UnsafeView", "ReshapeAlias", "Unsqueeze", "Squeeze",    "Expand", "Clone",
      "ToCopy", "Div",        "Mul",          "Add",       "Sub",        "Neg",    "Tanh",
      "Clamp",  "ClampMin",   "ClampMax",     "Where",     "MaskedFill", "Pow",    "Exp"};
  static const char* const kNews[] = {"Mm", "Addmm", "Bmm", "Baddbmm", "Embedding", "Linear"};
  const auto name = node.name();  // e.g. "DivBackward0"; "AddmmBackward0" is not "Add"'s
  auto is = [&](const char* op) { return name.rfind(std::string(op) + "Backward", 0) == 0; };
  for (const char* op : kKeeps) {
    if (is(op)) return LastDim::kKept;
  }
  for (const char* op : kNews) {
    if (is(op)) return LastDim::kNew;
  }
  return LastDim::kMixed;
}

}  // namespace hyper_parallel::dtensor
