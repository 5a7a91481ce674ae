#include <hyper_parallel/core/tensor_parallel/grad_utils.h>

#include <cmath>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/dtensor/dtensor.h>
#include <hyper_parallel/core/nn/parameter_layout.h>

namespace hyper_parallel::tensor_parallel {
namespace {

struct Entry {
  std::string name;
  at::Tensor param;
  std::optional<nn::ParameterLayout> layout;  // nullopt: unsharded
};

std::vector<Entry> entries(torch::nn::Module& root) {
  std::vector<Entry> out;
  for (const auto& p : root.named_parameters(/*recurse=*/true)) {
    out.push_back({p.key(), p.value(), nn::recorded_layout(p.value())});
  }
  return out;
}

bool is_sharded(const std::optional<nn::ParameterLayout>& layout) {
  if (!layout) return false;
  for (const auto& p : layout->placements) {
    if (!p.is_replicate()) return true;
  }
  return false;
}

double clip(const std::vector<Entry>& params, double max_norm) {
  TORCH_CHECK_VALUE(max_norm > 0, "clip_grad_norm_: expected max_norm > 0, got ", max_norm);
  // Squared norms summed as tensors; one .item() at the end, not one per parameter.
  at::Tensor replicated_sq = at::zeros({1}, at::kDouble);
  at::Tensor sharded_sq = at::zeros({1}, at::kDouble);
  std::optional<dtensor::DeviceMesh> mesh;
  std::vector<at::Tensor> grads;
  for (const auto& e : params) {
    const auto& g = e.param.grad();
    if (!g.defined()) continue;
    grads.push_back(g);
    const auto sq = g.to(at::kDouble).pow(2).sum();
    if (is_sharded(e.layout)) {
      TORCH_CHECK(!mesh || *mesh == e.layout->mesh,
                  "clip_grad_norm_: expected every sharded parameter on one mesh, got ", e.name,
                  " on another");
      mesh = e.layout->mesh;
      sharded_sq += sq;
    } else {
      replicated_sq += sq;
    }
  }
  if (mesh) sharded_sq = comm::all_reduce(sharded_sq, comm::ReduceOp::kSum, mesh->get_group(0));
  const double norm = std::sqrt((replicated_sq + sharded_sq).item<double>());
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1) {
    at::NoGradGuard no_grad;
    for (auto& g : grads) g.mul_(scale);
  }
  return norm;
}

at::Tensor full_value(const at::Tensor& t, const std::optional<nn::ParameterLayout>& layout) {
  at::NoGradGuard no_grad;
  if (!is_sharded(layout)) return t.detach();
  return dtensor::DTensor::from_local(t.detach(), layout->mesh, layout->placements,
                                      dtensor::FromLocalOptions().shape(layout->global_shape))
      .full_tensor();
}

}  // namespace

double clip_grad_norm_(torch::nn::Module& module, double max_norm) { return clip(entries(module), max_norm); }

double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm) {
  std::vector<Entry> params;
  for (size_t i = 0; i < parameters.size(); ++i) {
    params.push_back({"parameter " + std::to_string(i), parameters[i], nn::recorded_layout(parameters[i])});
  }
  return clip(params, max_norm);
}

at::Tensor full_tensor(const at::Tensor& param) {
  return full_value(param, nn::recorded_layout(param)).clone();
}

std::vector<std::pair<std::string, at::Tensor>> full_named_parameters(torch::nn::Module& module,
                                                                      bool gradients) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& e : entries(module)) {
    const at::Tensor t = gradients ? e.param.grad() : e.param;
    if (!t.defined()) continue;
    out.emplace_back(e.name, full_value(t, e.layout).clone());
  }
  return out;
}

}  // namespace hyper_parallel::tensor_parallel
