#pragma once
// nn::Linear: y = x Wᵀ + b, with hook points so parallel styles can shard it from outside.

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <hyper_parallel/core/nn/hookable_module.h>

namespace hyper_parallel::nn {

/// Usage:
///   Linear fc(LinearOptions(256, 1024).bias(false));
struct LinearOptions {
  LinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(int64_t, in_features);
  TORCH_ARG(int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
};

class LinearImpl : public torch::nn::Cloneable<LinearImpl>, public HookableModule {
 public:
  LinearImpl(int64_t in_features, int64_t out_features)
      : LinearImpl(LinearOptions(in_features, out_features)) {}
  explicit LinearImpl(const LinearOptions& options);

  /// Parameters as torch.nn.Linear: uniform(-1/sqrt(in), 1/sqrt(in)).
  void reset() override;
  /// Input [..., in_features] -> [..., out_features] (local shapes once a style sharded it).
  at::Tensor forward(const at::Tensor& input);
  ModuleKind module_kind() const override { return ModuleKind::kLinear; }
  void pretty_print(std::ostream& stream) const override;

  LinearOptions options;
  at::Tensor weight;  // [out_features, in_features]
  at::Tensor bias;    // [out_features], undefined without bias
};
TORCH_MODULE(Linear);

}  // namespace hyper_parallel::nn
