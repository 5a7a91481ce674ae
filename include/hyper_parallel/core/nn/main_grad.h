#pragma once
// A parameter's main gradient: where fully_shard puts a shard's reduced gradient instead of its
// .grad when MixedPrecisionPolicy::apply_grad_on_fp32_main_grad is set (HyperParallel's
// fully_shard, after Megatron's main_grad), and the gradient clip_grad_norm_ reads when a
// parameter has one. It keeps the reduction's dtype, not the shard's: bf16 shards reduced in
// fp32 get an fp32 gradient, summed in fp32 over the steps' backwards, for an optimizer that
// reads main_grad. Each synced backward adds its reduced gradient to the main gradient in place
// (a buffer the caller made, Megatron's, gets it; set when there is none); .grad is left as it
// is. Clearing it between steps is the caller's: set_main_grad(param, {}) or
// FSDPModule::zero_grad.
//
// Where main gradients live: by default a side table that never keeps a parameter alive; a front
// end keeps them where its users look (Python: the parameter's `main_grad` attribute) by
// installing a MainGradStore once, before any backward.
//
// Usage:
//   fully_shard::fully_shard(*model, fully_shard::FullyShardOptions().mp_policy(
//       fully_shard::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat)
//           .apply_grad_on_fp32_main_grad(true)));
//   loss.backward();
//   for (auto& p : model->parameters()) step_on(p, nn::main_grad(p));  // fp32; p.grad() undefined
//   for (auto& p : model->parameters()) nn::set_main_grad(p, {});

#include <functional>

#include <ATen/core/Tensor.h>

namespace hyper_parallel::nn {

/// `param`'s main gradient, or an undefined tensor if it has none.
at::Tensor main_grad(const at::Tensor& param);

/// Sets (undefined: clears) `param`'s main gradient.
void set_main_grad(const at::Tensor& param, at::Tensor grad);

/// Where main gradients are read and written.
struct MainGradStore {
  std::function<at::Tensor(const at::Tensor& param)> get;
  std::function<void(const at::Tensor& param, at::Tensor grad)> set;
};

/// Replaces the default side table (both functions must be set). Not thread-safe against a
/// running backward: install it at startup.
void set_main_grad_store(MainGradStore store);

}  // namespace hyper_parallel::nn
