#include <hyper_parallel/core/nn/rms_norm.h>

#include <ATen/ATen.h>

namespace hyper_parallel::nn {

RMSNormImpl::RMSNormImpl(const RMSNormOptions& options_) : options(options_) {
  TORCH_CHECK(options.dim() >= 1, "nn::RMSNorm: expected a positive dim, got ", options.dim());
  reset();
}

void RMSNormImpl::reset() { weight = register_parameter("weight", at::ones({options.dim()})); }

at::Tensor RMSNormImpl::forward(const at::Tensor& input) {
  auto x = run_input_hooks(input);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == options.dim(), "nn::RMSNorm: expected input [..., ",
              options.dim(), "], got ", x.sizes());
  auto x32 = x.to(at::kFloat);
  auto normed = x32 * at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + options.eps());
  return run_output_hooks(normed.to(x.scalar_type()) * parameter("weight", weight));
}

void RMSNormImpl::pretty_print(std::ostream& stream) const {
  stream << "hyper_parallel::nn::RMSNorm(dim=" << options.dim() << ", eps=" << options.eps();
  print_parallel_state(stream);
  stream << ")";
}

}  // namespace hyper_parallel::nn
