#pragma once
// nn::RMSNorm: x / sqrt(mean(x²) + eps) * weight over the last dim (computed in float32).

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <hyper_parallel/core/nn/hookable_module.h>

namespace hyper_parallel::nn {

/// Usage:
///   RMSNorm norm(RMSNormOptions(256).eps(1e-5));
struct RMSNormOptions {
  explicit RMSNormOptions(int64_t dim) : dim_(dim) {}
  TORCH_ARG(int64_t, dim);
  TORCH_ARG(double, eps) = 1e-5;
};

class RMSNormImpl : public torch::nn::Cloneable<RMSNormImpl>, public HookableModule {
 public:
  explicit RMSNormImpl(int64_t dim) : RMSNormImpl(RMSNormOptions(dim)) {}
  explicit RMSNormImpl(const RMSNormOptions& options);

  void reset() override;  // weight = 1
  at::Tensor forward(const at::Tensor& input);
  void pretty_print(std::ostream& stream) const override;

  RMSNormOptions options;
  at::Tensor weight;  // [dim]
};
TORCH_MODULE(RMSNorm);

}  // namespace hyper_parallel::nn
