#include <hyper_parallel/core/tensor_parallel/grad_utils.h>

#include <cmath>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/dtensor/dtensor.h>
#include <hyper_parallel/core/nn/main_grad.h>
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

// Squared gradient norms summed over the ranks that hold different pieces of the same
// parameters: per (mesh, set of mesh dims that shard), the local sums all-reduced over each of
// those dims once (a Replicate dim holds copies: no sum over it).
struct ShardedSums {
  struct Bucket {
    dtensor::DeviceMesh mesh;
    std::vector<int64_t> dims;
    at::Tensor sum;
  };
  std::vector<Bucket> buckets;

  void add(const nn::ParameterLayout& layout, const at::Tensor& sq) {
    std::vector<int64_t> dims;
    for (size_t d = 0; d < layout.placements.size(); ++d) {
      if (!layout.placements[d].is_replicate()) dims.push_back(static_cast<int64_t>(d));
    }
    for (auto& b : buckets) {
      if (b.mesh == layout.mesh && b.dims == dims) {
        b.sum += sq;
        return;
      }
    }
    buckets.push_back({layout.mesh, dims, sq.clone()});
  }

  at::Tensor total() const {
    auto out = at::zeros({}, at::kDouble);
    for (const auto& b : buckets) {
      auto s = b.sum;
      for (int64_t d : b.dims)
        s = comm::all_reduce(s.reshape({1}), comm::ReduceOp::kSum, b.mesh.get_group(d));
      out += s.reshape({});
    }
    return out;
  }
};

// The gradient clipping reads: the main gradient where the parameter has one (fully_shard's
// apply_grad_on_fp32_main_grad leaves .grad undefined), else .grad.
at::Tensor gradient_of(const at::Tensor& param) {
  auto main = nn::main_grad(param);
  return main.defined() ? main : param.grad();
}

// The global L2 norm of the parameters' gradients, and the gradients themselves.
std::pair<double, std::vector<at::Tensor>> global_norm(const std::vector<Entry>& params) {
  // Squared norms summed as tensors; one .item() at the end, not one per parameter.
  at::Tensor replicated_sq = at::zeros({}, at::kDouble);
  ShardedSums sharded;
  std::vector<at::Tensor> grads;
  for (const auto& e : params) {
    const auto g = gradient_of(e.param);
    if (!g.defined()) continue;
    grads.push_back(g);
    const auto sq = g.to(at::kDouble).pow(2).sum();
    if (is_sharded(e.layout)) {
      sharded.add(*e.layout, sq);
    } else {
      replicated_sq += sq;
    }
  }
  return {std::sqrt((replicated_sq + sharded.total()).item<double>()), std::move(grads)};
}

double clip(const std::vector<Entry>& params, double max_norm) {
  TORCH_CHECK_VALUE(max_norm >= 0, "clip_grad_norm_: expected max_norm >= 0, got ", max_norm);
  auto [norm, grads] = global_norm(params);
  // As torch's: a nan norm makes the gradients nan, an inf one zero (or nan where they are inf).
  const double scale = max_norm / (norm + 1e-6);
  if (!(scale >= 1)) {
    at::NoGradGuard no_grad;
    for (auto& g : grads) g.mul_(scale);
  }
  return norm;
}

std::vector<Entry> entries_of(const std::vector<at::Tensor>& parameters) {
  std::vector<Entry> params;
  for (size_t i = 0; i < parameters.size(); ++i) {
    params.push_back({"parameter " + std::to_string(i), parameters[i], nn::recorded_layout(parameters[i])});
  }
  return params;
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
  return clip(entries_of(parameters), max_norm);
}

double grad_norm(const std::vector<at::Tensor>& parameters) {
  return global_norm(entries_of(parameters)).first;
}

at::Tensor full_tensor(const at::Tensor& param) {
  return full_value(param, nn::recorded_layout(param)).clone();
}

at::Tensor full_tensor(const at::Tensor& param, const at::Tensor& value) {
  TORCH_CHECK_VALUE(value.defined() && value.sizes() == param.sizes(),
                    "full_tensor: expected a value of the parameter's local shape ", param.sizes(), ", got ",
                    value.defined() ? value.sizes() : c10::IntArrayRef{});
  return full_value(value, nn::recorded_layout(param)).clone();
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
