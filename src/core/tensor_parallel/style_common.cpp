#include "style_common.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>

#include <hyper_parallel/core/nn/matmul.h>
#include <hyper_parallel/core/nn/parameter_layout.h>
#include <hyper_parallel/core/tensor_parallel/parallelize.h>
#include <hyper_parallel/core/tensor_parallel/parameter_sharding.h>

namespace hyper_parallel::tensor_parallel {

using dtensor::DeviceMesh;
using dtensor::DTensor;
using dtensor::Placement;
using dtensor::Placements;
using dtensor::Replicate;

namespace detail {

nn::HookableModule& hookable(const char* style, torch::nn::Module& module) {
  auto* hm = dynamic_cast<nn::HookableModule*>(&module);
  TORCH_CHECK(hm != nullptr, style, ": expected a module of this library (hyper_parallel::nn or a ",
              "HookableModule), got ", module.name());
  return *hm;
}

ModuleTarget target_of(nn::HookableModule& hm, torch::nn::Module& module) {
  ModuleTarget target{hm.module_kind(), module.name(), {}, at::kFloat};
  const auto params = module.named_parameters(/*recurse=*/false);
  if (const auto* weight = params.find("weight")) {
    target.weight_shape = weight->sizes().vec();
    target.weight_dtype = weight->scalar_type();
  }
  return target;
}

at::Tensor prepare_column_output(const char* style, const at::Tensor& output, const DeviceMesh& mesh,
                                 const Placement& output_layouts, bool use_local_output,
                                 std::optional<int64_t> features) {
  std::optional<std::vector<int64_t>> shape;
  if (features) {
    TORCH_CHECK_VALUE(output.dim() >= 1, style, ": expected an output with a feature dim, got a scalar");
    shape = output.sizes().vec();
    shape->back() = *features;
  }
  return prepare(output, mesh, dtensor::Shard(-1), output_layouts, use_local_output, shape);
}

int64_t output_features(torch::nn::Module& module, nn::ModuleKind kind) {
  const auto layout = nn::recorded_layout(module.named_parameters(false)["weight"]);
  TORCH_INTERNAL_ASSERT(layout, "output_features: the weight was laid out by sharding_target");
  return layout->global_shape[kind == nn::ModuleKind::kLinear ? 0 : 1];
}

namespace {

std::optional<std::string> first_submodule_parameter(const torch::nn::Module& module) {
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    if (item.key().find('.') != std::string::npos) return item.key();
  }
  return std::nullopt;
}

}  // namespace

nn::HookableModule& sharding_target(const ParallelStyle& style, torch::nn::Module& module,
                                    const DeviceMesh& mesh, std::optional<int64_t> src_data_rank) {
  auto& hm = hookable(style.name().c_str(), module);
  std::vector<std::pair<std::string, at::Tensor>> parameters;  // handles to the module's tensors
  for (const auto& item : module.named_parameters(/*recurse=*/false))
    parameters.emplace_back(item.key(), item.value());
  // The hooks see the module's own reads (HookableModule::parameter) only: a submodule's
  // parameter would keep this rank's part of its gradient.
  const auto held_below = first_submodule_parameter(module);
  TORCH_CHECK_NOT_IMPLEMENTED(
      !held_below, style.name(), ": expected a module whose parameters are all its own, got ", module.name(),
      " whose submodule holds '", held_below.value_or(""), "' (apply the style to that submodule)");
  std::optional<std::string> claimed_by;
  if (hm.forward_kernel() != nullptr) claimed_by = hm.forward_kernel()->name();
  const auto summed =
      lay_out_parameters(style, target_of(hm, module), parameters, claimed_by, mesh, src_data_rank);
  sum_gradients_of_reads(style.name(), hm, module.name(), mesh, parameters, summed);
  return hm;
}

void sum_gradients_of_reads(const std::string& style, nn::HookableModule& hm, const std::string& module_type,
                            const DeviceMesh& mesh,
                            const std::vector<std::pair<std::string, at::Tensor>>& parameters,
                            const std::vector<std::string>& names) {
  if (names.empty()) return;
  std::vector<std::pair<std::string, at::Tensor>> summed;
  for (const auto& p : parameters) {
    if (std::find(names.begin(), names.end(), p.first) != names.end()) summed.push_back(p);
  }
  // The ones a forward with grad has not read yet (through HookableModule::parameter).
  auto unread = std::make_shared<std::vector<std::string>>();
  hm.add_input_hook([summed, unread](std::vector<at::Tensor> inputs) {
    unread->clear();
    for (const auto& [name, param] : summed) {
      if (param.requires_grad()) unread->push_back(name);
    }
    return inputs;
  });
  hm.add_parameter_read_hook(
      [names, unread, mesh](const std::string& name, const at::Tensor&, const at::Tensor& read) {
        if (std::find(names.begin(), names.end(), name) == names.end()) return read;
        unread->erase(std::remove(unread->begin(), unread->end(), name), unread->end());
        return sum_gradient_on_read(read, mesh);
      });
  // A forward that reads a parameter otherwise (a HookableModule of the user's that reads the
  // member itself) would leave its gradient this rank's part only.
  hm.add_output_hook([style, module_type, unread](std::vector<at::Tensor> outputs) {
    TORCH_CHECK_VALUE(
        !torch::autograd::GradMode::is_enabled() || unread->empty(), style, ": expected ", module_type,
        "'s forward to read its parameter '", unread->empty() ? "" : unread->front(),
        "' through HookableModule::parameter() (its gradient is summed over the mesh there), got a "
        "forward with grad that did not");
    return outputs;
  });
}

std::vector<ParameterSharding> shard_each(const std::vector<std::string>& parameters,
                                          std::vector<ParameterSharding> table) {
  std::vector<ParameterSharding> rows;
  for (auto& row : table) {
    if (std::find(parameters.begin(), parameters.end(), row.name) != parameters.end())
      rows.push_back(std::move(row));
  }
  return rows;
}

DTensor as_dtensor(const at::Tensor& local, const DeviceMesh& mesh, const Placement& layout,
                   const std::optional<std::vector<int64_t>>& shape) {
  if (auto tagged = DTensor::from_tagged(local)) {
    if (tagged->device_mesh() == mesh) return *tagged;
  }
  return DTensor::from_local(local, mesh, {layout}, dtensor::FromLocalOptions().shape(shape));
}

at::Tensor prepare(const at::Tensor& local, const DeviceMesh& mesh, const Placement& from,
                   const Placement& to, bool use_local_output,
                   const std::optional<std::vector<int64_t>>& shape) {
  DTensor d = as_dtensor(local, mesh, from, shape);
  if (d.placements() != Placements{to}) d = d.redistribute({to});
  return use_local_output ? d.to_local() : d.to_local_tagged();
}

at::Tensor replicate_for_column(const at::Tensor& local, const DeviceMesh& mesh, const Placement& layout) {
  DTensor d = as_dtensor(local, mesh, layout);
  if (d.placements() != Placements{Replicate()}) d = d.redistribute({Replicate()});
  return d.to_local({dtensor::Partial()});
}

at::Tensor rowwise_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                          const DeviceMesh& mesh, const Placement& output, bool use_local_output) {
  auto partial = nn::linear(x, weight);
  const auto reduced = DTensor::from_local(partial, mesh, {dtensor::Partial()}).redistribute({output});
  auto y = reduced.to_local();
  if (bias.defined()) {
    // Shard on the features: this rank's columns of the bias.
    const bool features_sharded = output.is_shard() && (output.dim() == -1 || output.dim() == y.dim() - 1);
    const int64_t p = mesh.size(0), k = mesh.get_local_rank(0), n = bias.size(0);
    y = y + (features_sharded ? bias.narrow(0, dtensor::shard_offset(n, p, k), dtensor::shard_size(n, p, k))
                              : bias);
  }
  if (use_local_output) return y;
  // The global shape is the reduced one: an uneven Shard output is not local size x ranks.
  return DTensor::from_local(y, mesh, {output}, dtensor::FromLocalOptions().shape(reduced.shape()))
      .to_local_tagged();
}

at::Tensor rowwise_embedding(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_size,
                             const DeviceMesh& mesh, const Placement& output, bool use_local_output,
                             std::optional<int64_t> padding_idx) {
  const auto shard = vocab_shard(ids, vocab_size, mesh);
  int64_t local_padding = -1;  // at::embedding's "none"
  if (padding_idx) {
    TORCH_CHECK_VALUE(*padding_idx >= -vocab_size && *padding_idx < vocab_size,
                      "RowwiseParallel: expected padding_idx in [", -vocab_size, ", ", vocab_size, "), got ",
                      *padding_idx);
    const int64_t row = *padding_idx < 0 ? *padding_idx + vocab_size : *padding_idx;
    if (row >= shard.start && row < shard.start + shard.size) local_padding = row - shard.start;
  }
  auto partial =
      at::embedding(weight, shard.local_ids, local_padding).masked_fill(shard.outside.unsqueeze(-1), 0);
  auto y = DTensor::from_local(partial, mesh, {dtensor::Partial()}).redistribute({output});
  return use_local_output ? y.to_local() : y.to_local_tagged();
}

at::Tensor sequence_sharded_input(const char* style, const at::Tensor& local, const DeviceMesh& mesh,
                                  const Placement& layout) {
  auto d = as_dtensor(local, mesh, layout);
  if (d.placements() != Placements{layout}) d = d.redistribute({layout});
  const int64_t seq = d.placements()[0].dim(), p = mesh.size(0);
  TORCH_CHECK_VALUE(d.shape()[seq] % p == 0, style, ": expected the sequence length (dim ", seq,
                    " of the global activation ", c10::IntArrayRef(d.shape()), ") divisible by world_size ",
                    p, ", got ", d.shape()[seq]);
  return d.to_local();
}

void check_layout_lists(const char* style, const char* a_name, const LayoutList& a, const char* b_name,
                        const LayoutList& b) {
  TORCH_CHECK_VALUE(a.size() == b.size(), style, ": expected ", a_name, " and ", b_name,
                    " of the same length, got ", a.size(), " and ", b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    TORCH_CHECK_VALUE(a[i].has_value() == b[i].has_value(), style, ": expected ", a_name, "[", i, "] and ",
                      b_name, "[", i, "] both set or both left alone");
  }
}

std::vector<at::Tensor> convert_all(const char* style, const char* what, std::vector<at::Tensor> xs,
                                    const DeviceMesh& mesh, const LayoutList& from, const LayoutList& to,
                                    bool use_local_output) {
  TORCH_CHECK_VALUE(xs.size() == from.size(), style, ": expected ", from.size(), " ", what, " (one per ",
                    "layout), got ", xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    if (!from[i] || !xs[i].defined()) continue;
    xs[i] = prepare(xs[i], mesh, *from[i], *to[i], use_local_output);
  }
  return xs;
}

VocabShard vocab_shard(const at::Tensor& ids, int64_t vocab_size, const DeviceMesh& mesh) {
  const int64_t p = mesh.size(0), k = mesh.get_local_rank(0);
  VocabShard v{dtensor::shard_offset(vocab_size, p, k), dtensor::shard_size(vocab_size, p, k), {}, {}};
  v.outside = (ids < v.start).logical_or(ids >= v.start + v.size);
  v.local_ids = (ids - v.start).masked_fill(v.outside, 0);
  return v;
}

}  // namespace detail

std::vector<std::string> lay_out_parameters(const ParallelStyle& style, const ModuleTarget& target,
                                            const std::vector<std::pair<std::string, at::Tensor>>& parameters,
                                            const std::optional<std::string>& claimed_by,
                                            const DeviceMesh& mesh, std::optional<int64_t> src_data_rank,
                                            const ModuleTypeNames& names) {
  const auto name = style.name();
  style.check_kind(target, names);
  check_tp_mesh(name.c_str(), mesh);
  check_unclaimed(name, target.type, claimed_by);
  std::vector<std::string> parameter_names;
  for (const auto& [parameter, value] : parameters) {
    TORCH_CHECK_VALUE(!nn::recorded_layout(value), name,
                      ": expected a module no style has parallelized yet, got ", target.type,
                      " whose parameter '", parameter,
                      "' is already laid out (by another style, or by fully_shard: apply styles first)");
    parameter_names.push_back(parameter);
  }
  style.check_target(target, mesh);
  std::vector<std::string> summed;
  for (const auto& row : style.parameter_shardings(target.kind, parameter_names)) {
    const auto it = std::find_if(parameters.begin(), parameters.end(),
                                 [&](const auto& p) { return p.first == row.name; });
    TORCH_INTERNAL_ASSERT(it != parameters.end(), name, ": the table names parameter '", row.name,
                          "' the module lacks");
    shard_parameter_in_place(it->second, mesh, row.placements, src_data_rank);
    if (row.sums_gradient) summed.push_back(row.name);
  }
  return summed;
}

}  // namespace hyper_parallel::tensor_parallel
