#include <hyper_parallel/core/tensor_parallel/mc2_style.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <hyper_parallel/core/dtensor/dtensor.h>
#include <hyper_parallel/nn/hookable_module.h>

#include "style_common.h"

namespace hyper_parallel::tensor_parallel {

using dtensor::DeviceMesh;
using dtensor::Placement;
using dtensor::Replicate;
using dtensor::Shard;

namespace {

// The checks both MC2 styles make before touching the module. They depend only on values every
// rank shares (shapes, dtype, world size), so all ranks fail together and none is left waiting
// in the collective that sharding the weights starts. Returns the (full) weight.
at::Tensor check_mc2_target(const char* style, torch::nn::Module& module, const DeviceMesh& mesh,
                            const MC2Contract& contract) {
  detail::sharding_target(style, module, {{nn::ModuleKind::kLinear}, "hyper_parallel::nn::Linear",
                                          "MC2 fuses Linear layers only"});
  contract.check_world_size(style, mesh.size(0));
  auto weight = module.named_parameters(/*recurse=*/false)["weight"];
  contract.check_dtype(style, weight.scalar_type());
  return weight;
}

// A sharded contraction extent, checked for the shard of every rank (they can differ by one
// chunk under torch.chunk sizes), so the verdict is the same everywhere.
void check_k_of_every_shard(const char* style, const char* what, const MC2Contract& contract,
                            int64_t extent, int64_t world_size) {
  for (int64_t k = 0; k < world_size; ++k) {
    contract.check_k(style, what, dtensor::shard_size(extent, world_size, k));
  }
}

}  // namespace

MC2ColwiseParallel::MC2ColwiseParallel(MC2ColwiseParallelOptions options)
    : options_(std::move(options)) {
  TORCH_CHECK(options_.input_layouts().is_shard(),
              "MC2ColwiseParallel: requires a sharded input layout (sequence parallelism: the "
              "fused op all-gathers the sequence), got input_layouts ",
              options_.input_layouts().str());
  TORCH_CHECK(options_.input_layouts().dim() != -1,
              "MC2ColwiseParallel: expected input_layouts Shard(sequence dim), got Shard(-1), the "
              "feature dim");
  TORCH_CHECK(!options_.output_layouts().is_partial(),
              "MC2ColwiseParallel: expected output_layouts Shard or Replicate, got ",
              options_.output_layouts().str());
}

void MC2ColwiseParallel::apply_to(torch::nn::Module& module, const DeviceMesh& mesh,
                                  std::optional<int64_t> src_data_rank) const {
  const char* style = "MC2ColwiseParallel";
  const auto& contract = options_.contract();
  const auto weight = check_mc2_target(style, module, mesh, contract);
  const int64_t p = mesh.size(0);
  contract.check_k(style, "contraction dim k (in_features)", weight.size(1));
  check_k_of_every_shard(style, "column backward contraction n_local (out_features / world_size)",
                         contract, weight.size(0), p);

  detail::shard_parameter(module, "weight", mesh, {Shard(0)}, src_data_rank);
  if (module.named_parameters(false).contains("bias")) {
    detail::shard_parameter(module, "bias", mesh, {Shard(0)}, src_data_rank);
  }
  const Placement in = options_.input_layouts();
  MC2Linear::from_linear(module).configure_mc2(MC2Mode::kAllGather, mesh.get_group(0), in.dim(),
                                               contract, options_.mc2_options());
  auto& hm = detail::hookable(style, module);
  // The input stays sequence-sharded: the fused op does the gather (no redistribute here).
  // Every rank must hold the same number of tokens; the global shape (exact for inputs tagged by
  // an upstream style) says whether they do, identically on every rank.
  hm.add_input_hook([mesh, in, p](std::vector<at::Tensor> inputs) {
    auto d = detail::as_dtensor(inputs[0], mesh, in);
    if (d.placements() != dtensor::Placements{in}) d = d.redistribute({in});
    const int64_t seq = d.placements()[0].dim();
    TORCH_CHECK(d.shape()[seq] % p == 0, "MC2ColwiseParallel: expected the sequence length (dim ",
                seq, " of the global activation ", c10::IntArrayRef(d.shape()),
                ") divisible by world_size ", p, ", got ", d.shape()[seq]);
    inputs[0] = d.to_local();
    return inputs;
  });
  detail::add_output_hook(hm, mesh, Shard(-1), options_.output_layouts(), options_.use_local_output());
}

MC2RowwiseParallel::MC2RowwiseParallel(MC2RowwiseParallelOptions options)
    : options_(std::move(options)) {
  TORCH_CHECK(options_.output_layouts().is_shard(),
              "MC2RowwiseParallel: requires a sharded output layout (sequence parallelism: the "
              "fused op reduce-scatters the sequence), got output_layouts ",
              options_.output_layouts().str());
  TORCH_CHECK(options_.output_layouts().dim() != -1,
              "MC2RowwiseParallel: expected output_layouts Shard(sequence dim), got Shard(-1), the "
              "feature dim");
  TORCH_CHECK(!options_.input_layouts().is_partial(),
              "MC2RowwiseParallel: expected input_layouts Shard or Replicate, got ",
              options_.input_layouts().str());
}

void MC2RowwiseParallel::apply_to(torch::nn::Module& module, const DeviceMesh& mesh,
                                  std::optional<int64_t> src_data_rank) const {
  const char* style = "MC2RowwiseParallel";
  const auto& contract = options_.contract();
  const auto weight = check_mc2_target(style, module, mesh, contract);
  const int64_t p = mesh.size(0);
  check_k_of_every_shard(style, "contraction dim k (in_features / world_size)", contract,
                         weight.size(1), p);
  // The backward all-gather-matmul multiplies dY [rows, out_features] by W: it contracts over n.
  contract.check_k(style, "row backward contraction n (out_features)", weight.size(0));

  detail::shard_parameter(module, "weight", mesh, {Shard(1)}, src_data_rank);
  if (module.named_parameters(false).contains("bias")) {
    // The fused backward gathers dY, so the bias gradient is complete on every rank.
    detail::shard_parameter(module, "bias", mesh, {Replicate()}, src_data_rank);
  }
  const Placement out = options_.output_layouts();
  MC2Linear::from_linear(module).configure_mc2(MC2Mode::kReduceScatter, mesh.get_group(0),
                                               out.dim(), contract, options_.mc2_options());
  auto& hm = detail::hookable(style, module);
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
