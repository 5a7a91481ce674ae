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

// ---- What both styles share ---------------------------------------------------------------

void MC2Style::check_kind(const ModuleTarget& target, const ModuleTypeNames& names) const {
  // MC2 fuses Linear layers: an Embedding is not supported, anything else is the wrong type.
  TORCH_CHECK_NOT_IMPLEMENTED(target.kind != nn::ModuleKind::kEmbedding, name(),
                              " does not support Embedding (got ", target.type,
                              "); MC2 fuses Linear layers only");
  TORCH_CHECK_TYPE(target.kind == nn::ModuleKind::kLinear, name(), ": expected ", names.linear, ", got ",
                   target.type, "; MC2 fuses Linear layers only");
}

void MC2Style::check_target(const ModuleTarget& target, const DeviceMesh& mesh) const {
  // Values every rank shares (shapes, world size): all ranks fail together, and none is left
  // waiting in the collective that sharding the weights starts. The dtype limit is the kernel's,
  // checked when the layer runs (a model is often parallelized in float32, then cast).
  const auto style = name();
  contract().check_world_size(style.c_str(), mesh.size(0));
  contract().check_weight(style.c_str(), mc2_mode(), target.weight_shape, mesh.size(0));
}

int64_t MC2Style::sequence_dim() const {
  // A tensor dim d < 0 counts the feature dim; among the leading dims it is d + 1.
  const int64_t d = sequence_layout().dim();
  return d >= 0 ? d : d + 1;
}

void MC2Style::apply_to(torch::nn::Module& module, const DeviceMesh& mesh,
                        std::optional<int64_t> src_data_rank) const {
  auto& hm = detail::sharding_target(*this, module, mesh, src_data_rank);
  MC2Linear::from_linear(module).configure_mc2(mc2_mode(), mesh.get_group(0), sequence_dim(), contract(),
                                               mc2_options());
  auto self = clone();
  const int64_t features = detail::output_features(module, nn::ModuleKind::kLinear);
  hm.add_input_hook([self, mesh](std::vector<at::Tensor> xs) {
    xs[0] = self->prepare_input(xs[0], mesh);
    return xs;
  });
  hm.add_output_hook([self, mesh, features](std::vector<at::Tensor> ys) {
    ys[0] = self->prepare_output(ys[0], mesh, features);
    return ys;
  });
}

namespace {

void check_sequence_layout(const char* style, const char* what, const char* fused, const Placement& layout) {
  TORCH_CHECK_VALUE(layout.is_shard(), style, ": requires a sharded ", what,
                    " layout (sequence parallelism: the "
                    "fused op ",
                    fused, " the sequence), got ", what, "_layouts ", layout.str());
  TORCH_CHECK_VALUE(layout.dim() != -1, style, ": expected ", what,
                    "_layouts Shard(sequence dim), got Shard(-1), "
                    "the feature dim");
}

}  // namespace

// ---- MC2ColwiseParallel -------------------------------------------------------------------

MC2ColwiseParallel::MC2ColwiseParallel(MC2ColwiseParallelOptions options) : options_(std::move(options)) {
  check_sequence_layout("MC2ColwiseParallel", "input", "all-gathers", options_.input_layouts());
  TORCH_CHECK_VALUE(!options_.output_layouts().is_partial(),
                    "MC2ColwiseParallel: expected output_layouts Shard or Replicate, got ",
                    options_.output_layouts().str());
}

std::vector<ParameterSharding> MC2ColwiseParallel::parameter_shardings(
    nn::ModuleKind, const std::vector<std::string>& parameters) const {
  return detail::shard_each(parameters, {{"weight", {Shard(0)}}, {"bias", {Shard(0)}}});
}

at::Tensor MC2ColwiseParallel::prepare_input(const at::Tensor& input, const DeviceMesh& mesh) const {
  return detail::sequence_sharded_input("MC2ColwiseParallel", input, mesh, options_.input_layouts());
}

at::Tensor MC2ColwiseParallel::prepare_output(const at::Tensor& output, const DeviceMesh& mesh,
                                              std::optional<int64_t> features) const {
  return detail::prepare_column_output("MC2ColwiseParallel", output, mesh, options_.output_layouts(),
                                       options_.use_local_output(), features);
}

// ---- MC2RowwiseParallel -------------------------------------------------------------------

MC2RowwiseParallel::MC2RowwiseParallel(MC2RowwiseParallelOptions options) : options_(std::move(options)) {
  check_sequence_layout("MC2RowwiseParallel", "output", "reduce-scatters", options_.output_layouts());
  TORCH_CHECK_VALUE(!options_.input_layouts().is_partial(),
                    "MC2RowwiseParallel: expected input_layouts Shard or Replicate, got ",
                    options_.input_layouts().str());
}

std::vector<ParameterSharding> MC2RowwiseParallel::parameter_shardings(
    nn::ModuleKind, const std::vector<std::string>& parameters) const {
  // The fused backward gathers dY, so the bias gradient is complete on every rank.
  return detail::shard_each(parameters, {{"weight", {Shard(1)}}, {"bias", {Replicate()}}});
}

at::Tensor MC2RowwiseParallel::prepare_input(const at::Tensor& input, const DeviceMesh& mesh) const {
  TORCH_CHECK_VALUE(input.dim() >= 2, "MC2RowwiseParallel: expected an activation [..., S, ..., H], got ",
                    input.sizes());
  return detail::prepare(input, mesh, options_.input_layouts(), Shard(input.dim() - 1), true);
}

at::Tensor MC2RowwiseParallel::prepare_output(const at::Tensor& output, const DeviceMesh& mesh,
                                              std::optional<int64_t> /*features: whole here*/) const {
  const auto& out = options_.output_layouts();
  return detail::prepare(output, mesh, out, out, options_.use_local_output());
}

}  // namespace hyper_parallel::tensor_parallel
