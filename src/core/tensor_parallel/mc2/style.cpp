#include <hyper_parallel/core/tensor_parallel/mc2/style.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <hyper_parallel/core/dtensor/dtensor.h>
#include <hyper_parallel/core/nn/hookable_module.h>

#include "../style_common.h"

namespace hyper_parallel::tensor_parallel {

using dtensor::DeviceMesh;
using dtensor::Placement;
using dtensor::Replicate;
using dtensor::Shard;

namespace {

// MC2 fuses Linear layers: an Embedding is not supported, anything else is the wrong type.
void check_kind(const char* style, nn::ModuleKind kind, const std::string& module_name,
                const char* linear_name) {
  TORCH_CHECK_NOT_IMPLEMENTED(kind != nn::ModuleKind::kEmbedding, style,
                              " does not support Embedding (got ", module_name,
                              "); MC2 fuses Linear layers only");
  TORCH_CHECK_TYPE(kind == nn::ModuleKind::kLinear, style, ": expected ", linear_name, ", got ",
                   module_name, "; MC2 fuses Linear layers only");
}

// The kind and the limits both MC2 styles check before touching a module. They depend only on
// values every rank shares (shapes, dtype, world size), so all ranks fail together and none is
// left waiting in the collective that sharding the weights starts.
void check_kind_and_common_limits(const char* style, nn::ModuleKind kind, const std::string& module_name,
                                  const char* linear_name, at::ScalarType dtype, const DeviceMesh& mesh,
                                  const MC2Contract& contract) {
  check_kind(style, kind, module_name, linear_name);
  contract.check_dtype(style, dtype);
  contract.check_world_size(style, mesh.size(0));
}

// For this library's modules: one of them, a Linear, not yet parallelized (a sharded weight
// would fail the limits for the wrong reason), then the contract on the full weight.
template <typename Style>
void check_module(const Style& style, torch::nn::Module& module, const DeviceMesh& mesh) {
  const auto name = style.name();
  auto& hm = detail::hookable(name.c_str(), module);
  check_kind(name.c_str(), hm.module_kind(), module.name(), "hyper_parallel::nn::Linear");
  // The kind is checked above (with the exception types Python sees); here: not yet parallelized.
  detail::sharding_target(name.c_str(), module, {{}, "a module of this library", "any kind"});
  const auto weight = module.named_parameters(/*recurse=*/false)["weight"];
  style.check_target(hm.module_kind(), module.name(), "hyper_parallel::nn::Linear", weight.sizes(),
                     weight.scalar_type(), mesh);
}

}  // namespace

MC2ColwiseParallel::MC2ColwiseParallel(MC2ColwiseParallelOptions options)
    : options_(std::move(options)) {
  TORCH_CHECK_VALUE(options_.input_layouts().is_shard(),
                    "MC2ColwiseParallel: requires a sharded input layout (sequence parallelism: the "
                    "fused op all-gathers the sequence), got input_layouts ",
                    options_.input_layouts().str());
  TORCH_CHECK_VALUE(options_.input_layouts().dim() != -1,
                    "MC2ColwiseParallel: expected input_layouts Shard(sequence dim), got Shard(-1), "
                    "the feature dim");
  TORCH_CHECK_VALUE(!options_.output_layouts().is_partial(),
                    "MC2ColwiseParallel: expected output_layouts Shard or Replicate, got ",
                    options_.output_layouts().str());
}

void MC2ColwiseParallel::check_target(nn::ModuleKind kind, const std::string& module_name,
                                      const char* linear_name, c10::IntArrayRef weight_shape,
                                      at::ScalarType dtype, const DeviceMesh& mesh) const {
  const char* style = "MC2ColwiseParallel";
  const auto& contract = options_.contract();
  check_kind_and_common_limits(style, kind, module_name, linear_name, dtype, mesh, contract);
  contract.check_weight(style, MC2Mode::kAllGather, weight_shape, mesh.size(0));
}

void MC2ColwiseParallel::apply_to(torch::nn::Module& module, const DeviceMesh& mesh,
                                  std::optional<int64_t> src_data_rank) const {
  check_module(*this, module, mesh);
  detail::shard_parameter(module, "weight", mesh, {Shard(0)}, src_data_rank);
  if (module.named_parameters(false).contains("bias")) {
    detail::shard_parameter(module, "bias", mesh, {Shard(0)}, src_data_rank);
  }
  const Placement in = options_.input_layouts();
  MC2Linear::from_linear(module).configure_mc2(MC2Mode::kAllGather, mesh.get_group(0), in.dim(),
                                               options_.contract(), options_.mc2_options());
  auto& hm = detail::hookable("MC2ColwiseParallel", module);
  // The input stays sequence-sharded: the fused op does the gather (no redistribute here).
  hm.add_input_hook([mesh, in](std::vector<at::Tensor> inputs) {
    inputs[0] = detail::sequence_sharded_input("MC2ColwiseParallel", inputs[0], mesh, in);
    return inputs;
  });
  detail::add_output_hook(hm, mesh, Shard(-1), options_.output_layouts(), options_.use_local_output());
}

MC2RowwiseParallel::MC2RowwiseParallel(MC2RowwiseParallelOptions options)
    : options_(std::move(options)) {
  TORCH_CHECK_VALUE(options_.output_layouts().is_shard(),
                    "MC2RowwiseParallel: requires a sharded output layout (sequence parallelism: the "
                    "fused op reduce-scatters the sequence), got output_layouts ",
                    options_.output_layouts().str());
  TORCH_CHECK_VALUE(options_.output_layouts().dim() != -1,
                    "MC2RowwiseParallel: expected output_layouts Shard(sequence dim), got Shard(-1), "
                    "the feature dim");
  TORCH_CHECK_VALUE(!options_.input_layouts().is_partial(),
                    "MC2RowwiseParallel: expected input_layouts Shard or Replicate, got ",
                    options_.input_layouts().str());
}

void MC2RowwiseParallel::check_target(nn::ModuleKind kind, const std::string& module_name,
                                      const char* linear_name, c10::IntArrayRef weight_shape,
                                      at::ScalarType dtype, const DeviceMesh& mesh) const {
  const char* style = "MC2RowwiseParallel";
  const auto& contract = options_.contract();
  check_kind_and_common_limits(style, kind, module_name, linear_name, dtype, mesh, contract);
  contract.check_weight(style, MC2Mode::kReduceScatter, weight_shape, mesh.size(0));
}

void MC2RowwiseParallel::apply_to(torch::nn::Module& module, const DeviceMesh& mesh,
                                  std::optional<int64_t> src_data_rank) const {
  check_module(*this, module, mesh);
  detail::shard_parameter(module, "weight", mesh, {Shard(1)}, src_data_rank);
  if (module.named_parameters(false).contains("bias")) {
    // The fused backward gathers dY, so the bias gradient is complete on every rank.
    detail::shard_parameter(module, "bias", mesh, {Replicate()}, src_data_rank);
  }
  const Placement out = options_.output_layouts();
  MC2Linear::from_linear(module).configure_mc2(MC2Mode::kReduceScatter, mesh.get_group(0),
                                               out.dim(), options_.contract(), options_.mc2_options());
  auto& hm = detail::hookable("MC2RowwiseParallel", module);
  const Placement in = options_.input_layouts();
  hm.add_input_hook([mesh, in](std::vector<at::Tensor> inputs) {
    TORCH_CHECK(inputs[0].dim() >= 2, "MC2RowwiseParallel: expected an activation [..., S, ..., H], got ",
                inputs[0].sizes());
    inputs[0] = detail::prepare(inputs[0], mesh, in, Shard(inputs[0].dim() - 1), true);
    return inputs;
  });
  detail::add_output_hook(hm, mesh, out, out, options_.use_local_output());
}

}  // namespace hyper_parallel::tensor_parallel
