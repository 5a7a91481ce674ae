#include <hyper_parallel/core/tensor_parallel/grad_utils.h>

#include <cmath>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/dtensor/dtensor.h>
#include <hyper_parallel/core/nn/hookable_module.h>

namespace hyper_parallel::tensor_parallel {
namespace {

struct Entry {
  std::string name;
  at::Tensor param;
  const nn::ParameterLayout* layout;  // nullptr: unsharded
};

std::vector<Entry> entries(torch::nn::Module& root) {
  std::vector<Entry> out;
  for (const auto& item : root.named_modules()) {
    auto* hm = dynamic_cast<nn::HookableModule*>(item.value().get());
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      out.push_back({prefix + p.key(), p.value(), hm ? hm->parameter_layout(p.key()) : nullptr});
    }
  }
  return out;
}

bool is_sharded(const nn::ParameterLayout* layout) {
  if (layout == nullptr) return false;
  for (const auto& p : layout->placements) {
    if (!p.is_replicate()) return true;
  }
  return false;
}

}  // namespace

double clip_grad_norm_(torch::nn::Module& module, double max_norm) {
  TORCH_CHECK(max_norm > 0, "clip_grad_norm_: expected max_norm > 0, got ", max_norm);
  // Squared norms summed as tensors; one .item() at the end, not one per parameter.
  at::Tensor replicated_sq = at::zeros({1}, at::kDouble);
  at::Tensor sharded_sq = at::zeros({1}, at::kDouble);
  std::optional<dtensor::DeviceMesh> mesh;
  std::vector<at::Tensor> grads;
  for (const auto& e : entries(module)) {
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
  const double total_sq = (replicated_sq + sharded_sq).item<double>();
  const double norm = std::sqrt(total_sq);
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1) {
    at::NoGradGuard no_grad;
    for (auto& g : grads) g.mul_(scale);
  }
  return norm;
}

std::vector<std::pair<std::string, at::Tensor>> full_named_parameters(torch::nn::Module& module,
                                                                      bool gradients) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  at::NoGradGuard no_grad;
  for (const auto& e : entries(module)) {
    at::Tensor t = gradients ? e.param.grad() : e.param.detach();
    if (!t.defined()) continue;
    if (is_sharded(e.layout)) {
      t = dtensor::DTensor::from_local(t, e.layout->mesh, e.layout->placements,
                                       dtensor::FromLocalOptions().shape(e.layout->global_shape))
              .full_tensor();
    }
    out.emplace_back(e.name, t.clone());
  }
  return out;
}

}  // namespace hyper_parallel::tensor_parallel
