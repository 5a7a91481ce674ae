#include <hyper_parallel/core/tensor_parallel/mc2_style.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <hyper_parallel/core/dtensor/dtensor.h>
#include <hyper_parallel/core/tensor_parallel/hookable_module.h>

#include "style_internal.h"

namespace hyper_parallel::tensor_parallel {

using dtensor::DeviceMesh;
using dtensor::Placement;
using dtensor::Replicate;
using dtensor::Shard;

namespace {

// The MC2 styles fuse Linear layers only.
void check_linear(const char* style, torch::nn::Module& module) {
  auto& hm = detail::hookable(style, module);
  TORCH_CHECK(hm.module_kind() == ModuleKind::kLinear, style,
              ": expected hyper_parallel::nn::Linear, got ", module.name(),
              "; MC2 fuses Linear layers only");
}

at::Tensor parameter(torch::nn::Module& module, const char* name) {
  return module.named_parameters(/*recurse=*/false)[name];
}

void add_output_hook(HookableModule& hm, const DeviceMesh& mesh, Placement produced, Placement wanted,
                     bool use_local_output) {
  hm.add_output_hook([=](std::vector<at::Tensor> outputs) {
    outputs[0] = detail::prepare(outputs[0], mesh, produced, wanted, use_local_output);
    return outputs;
  });
}

}  // namespace

MC2ColwiseParallel::MC2ColwiseParallel(MC2ColwiseParallelOptions options)
    : options_(std::move(options)) {
  TORCH_CHECK(options_.input_layouts().is_shard(),
              "MC2ColwiseParallel: requires a sharded input layout (sequence parallelism: the "
              "fused op all-gathers the sequence), got input_layouts ",
              options_.input_layouts().str());
  TORCH_CHECK(!options_.output_layouts().is_partial(),
              "MC2ColwiseParallel: expected output_layouts Shard or Replicate, got ",
              options_.output_layouts().str());
}

void MC2ColwiseParallel::apply(torch::nn::Module& module, const DeviceMesh& mesh) const {
  const char* style = "MC2ColwiseParallel";
  detail::check_tp_mesh(style, mesh);
  check_linear(style, module);
  const auto& contract = options_.contract();
  const int64_t p = mesh.size(0);
  contract.check_world_size(style, p);
  auto weight = parameter(module, "weight");
  contract.check_dtype(style, weight.scalar_type());
  contract.check_k(style, "contraction dim k (in_features)", weight.size(1));
  contract.check_k(style, "column backward contraction n_local (out_features / world_size)",
                   dtensor::shard_size(weight.size(0), p, mesh.get_local_rank(0)));

  detail::shard_parameter(module, "weight", mesh, {Shard(0)});
  if (module.named_parameters(false).contains("bias")) {
    detail::shard_parameter(module, "bias", mesh, {Shard(0)});
  }
  const Placement in = options_.input_layouts();
  MC2Linear::from_linear(module).configure_mc2("all_gather", mesh.get_group(0), p, in.dim(), contract,
                                               options_.mc2_options());
  auto& hm = detail::hookable(style, module);
  // The input stays sequence-sharded: the fused op does the gather (no redistribute here).
  hm.add_input_hook([mesh, in](std::vector<at::Tensor> inputs) {
    inputs[0] = detail::prepare(inputs[0], mesh, in, in, /*use_local_output=*/true);
    return inputs;
  });
  add_output_hook(hm, mesh, Shard(-1), options_.output_layouts(), options_.use_local_output());
}

MC2RowwiseParallel::MC2RowwiseParallel(MC2RowwiseParallelOptions options)
    : options_(std::move(options)) {
  TORCH_CHECK(options_.output_layouts().is_shard(),
              "MC2RowwiseParallel: requires a sharded output layout (sequence parallelism: the "
              "fused op reduce-scatters the sequence), got output_layouts ",
              options_.output_layouts().str());
  TORCH_CHECK(!options_.input_layouts().is_partial(),
              "MC2RowwiseParallel: expected input_layouts Shard or Replicate, got ",
              options_.input_layouts().str());
}

void MC2RowwiseParallel::apply(torch::nn::Module& module, const DeviceMesh& mesh) const {
  const char* style = "MC2RowwiseParallel";
  detail::check_tp_mesh(style, mesh);
  check_linear(style, module);
  const auto& contract = options_.contract();
  const int64_t p = mesh.size(0);
  contract.check_world_size(style, p);
  auto weight = parameter(module, "weight");
  contract.check_dtype(style, weight.scalar_type());
  contract.check_k(style, "contraction dim k (in_features / world_size)",
                   dtensor::shard_size(weight.size(1), p, mesh.get_local_rank(0)));

  detail::shard_parameter(module, "weight", mesh, {Shard(1)});
  if (module.named_parameters(false).contains("bias")) {
    // The fused backward gathers dY, so the bias gradient is complete on every rank.
    detail::shard_parameter(module, "bias", mesh, {Replicate()});
  }
  const Placement out = options_.output_layouts();
  MC2Linear::from_linear(module).configure_mc2("reduce_scatter", mesh.get_group(0), p, out.dim(),
                                               contract, options_.mc2_options());
  auto& hm = detail::hookable(style, module);
  const Placement in = options_.input_layouts();
  hm.add_input_hook([mesh, in](std::vector<at::Tensor> inputs) {
    TORCH_CHECK(inputs[0].dim() >= 2, "MC2RowwiseParallel: expected an activation [..., S, ..., H], got ",
                inputs[0].sizes());
    inputs[0] = detail::prepare(inputs[0], mesh, in, Shard(inputs[0].dim() - 1), true);
    return inputs;
  });
  add_output_hook(hm, mesh, out, out, options_.use_local_output());
}

}  // namespace hyper_parallel::tensor_parallel
