#include "style_common.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/counters.h>

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

nn::HookableModule& sharding_target(const char* style, torch::nn::Module& module,
                                    const ModuleKinds& accepted) {
  auto& hm = hookable(style, module);
  const auto& kinds = accepted.kinds;
  TORCH_CHECK(kinds.empty() || std::find(kinds.begin(), kinds.end(), hm.module_kind()) != kinds.end(),
              style, ": expected ", accepted.expected, ", got ", module.name(), "; ", accepted.reason);
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    TORCH_CHECK(hm.parameter_layout(item.key()) == nullptr, style, ": expected a module no style ",
                "has parallelized yet, got ", module.name(), " whose parameter '", item.key(),
                "' is already laid out by another style");
  }
  TORCH_CHECK(hm.forward_kernel() == nullptr, style, ": expected a module no style has ",
              "parallelized yet, got ", module.name(), " already using ", hm.forward_kernel()->name());
  return hm;
}

void shard_tensor_in_place(const at::Tensor& param, const DeviceMesh& mesh,
                           const Placements& placements, std::optional<int64_t> src_data_rank) {
  // The source rank's values win, so all ranks hold shards of one tensor even if their
  // initialisation differed (unless src_data_rank is nullopt: then each shards its own copy).
  auto local = dtensor::distribute_tensor(param.detach(), mesh, placements, src_data_rank).to_local();
  at::NoGradGuard no_grad;
  // set_data keeps the parameter object (and an optimizer's reference to it) valid.
  param.set_data(local.contiguous());
}

void sum_gradient_over_mesh(const at::Tensor& param, const DeviceMesh& mesh) {
  if (mesh.size(0) == 1 || !param.requires_grad()) return;
  auto group = mesh.get_group(0);
  param.register_hook([group](const at::Tensor& grad) {
    comm::CommRegion region("grad_sync");
    return comm::all_reduce(grad, comm::ReduceOp::kSum, group);
  });
}

void shard_parameter(torch::nn::Module& module, const std::string& name, const DeviceMesh& mesh,
                     const Placements& placements, std::optional<int64_t> src_data_rank) {
  auto params = module.named_parameters(/*recurse=*/false);  // handles to the module's tensors
  auto* param = params.find(name);
  TORCH_INTERNAL_ASSERT(param != nullptr, "shard_parameter: no parameter '", name, "'");
  const auto shape = param->sizes().vec();
  shard_tensor_in_place(*param, mesh, placements, src_data_rank);
  hookable("shard_parameter", module).set_parameter_layout(name, {mesh, placements, shape});
}

void sync_partial_gradient(torch::nn::Module& module, const std::string& name,
                           const DeviceMesh& mesh, std::optional<int64_t> src_data_rank) {
  auto params = module.named_parameters(/*recurse=*/false);
  auto* param = params.find(name);
  TORCH_INTERNAL_ASSERT(param != nullptr, "sync_partial_gradient: no parameter '", name, "'");
  // Keep the values identical on every rank (they are replicated), then record the layout.
  shard_parameter(module, name, mesh, {Replicate()}, src_data_rank);
  sum_gradient_over_mesh(*param, mesh);
}

DTensor as_dtensor(const at::Tensor& local, const DeviceMesh& mesh, const Placement& layout) {
  if (auto tagged = DTensor::from_tagged(local)) {
    if (tagged->device_mesh() == mesh) return *tagged;
  }
  return DTensor::from_local(local, mesh, {layout});
}

at::Tensor prepare(const at::Tensor& local, const DeviceMesh& mesh, const Placement& from,
                   const Placement& to, bool use_local_output) {
  DTensor d = as_dtensor(local, mesh, from);
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
  auto partial = at::linear(x, weight);
  auto y = DTensor::from_local(partial, mesh, {dtensor::Partial()}).redistribute({output}).to_local();
  if (bias.defined()) y = y + bias;
  if (use_local_output) return y;
  return DTensor::from_local(y, mesh, {output}).to_local_tagged();
}

at::Tensor rowwise_embedding(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_size,
                             const DeviceMesh& mesh, const Placement& output, bool use_local_output) {
  const auto shard = vocab_shard(ids, vocab_size, mesh);
  auto partial = at::embedding(weight, shard.local_ids).masked_fill(shard.outside.unsqueeze(-1), 0);
  auto y = DTensor::from_local(partial, mesh, {dtensor::Partial()}).redistribute({output});
  return use_local_output ? y.to_local() : y.to_local_tagged();
}

at::Tensor sequence_sharded_input(const char* style, const at::Tensor& local, const DeviceMesh& mesh,
                                  const Placement& layout) {
  auto d = as_dtensor(local, mesh, layout);
  if (d.placements() != Placements{layout}) d = d.redistribute({layout});
  const int64_t seq = d.placements()[0].dim(), p = mesh.size(0);
  TORCH_CHECK_VALUE(d.shape()[seq] % p == 0, style, ": expected the sequence length (dim ", seq,
                    " of the global activation ", c10::IntArrayRef(d.shape()),
                    ") divisible by world_size ", p, ", got ", d.shape()[seq]);
  return d.to_local();
}

VocabShard vocab_shard(const at::Tensor& ids, int64_t vocab_size, const DeviceMesh& mesh) {
  const int64_t p = mesh.size(0), k = mesh.get_local_rank(0);
  VocabShard v{dtensor::shard_offset(vocab_size, p, k), dtensor::shard_size(vocab_size, p, k), {}, {}};
  v.outside = (ids < v.start).logical_or(ids >= v.start + v.size);
  v.local_ids = (ids - v.start).masked_fill(v.outside, 0);
  return v;
}

void add_output_hook(nn::HookableModule& module, const DeviceMesh& mesh, const Placement& produced,
                     const Placement& wanted, bool use_local_output) {
  module.add_output_hook([=](std::vector<at::Tensor> outputs) {
    outputs[0] = prepare(outputs[0], mesh, produced, wanted, use_local_output);
    return outputs;
  });
}

}  // namespace detail

}  // namespace hyper_parallel::tensor_parallel
