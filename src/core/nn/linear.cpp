#include <hyper_parallel/core/nn/linear.h>

#include <cmath>

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <hyper_parallel/core/nn/matmul.h>

namespace hyper_parallel::nn {

LinearImpl::LinearImpl(const LinearOptions& options_) : options(options_) {
  TORCH_CHECK(options.in_features() >= 1 && options.out_features() >= 1,
              "nn::Linear: expected positive in_features and out_features, got ", options.in_features(),
              " and ", options.out_features());
  reset();
}

void LinearImpl::reset() {
  weight = register_parameter("weight", at::empty({options.out_features(), options.in_features()}));
  bias = options.bias() ? register_parameter("bias", at::empty({options.out_features()})) : at::Tensor();
  const double bound = 1.0 / std::sqrt(static_cast<double>(options.in_features()));
  torch::nn::init::uniform_(weight, -bound, bound);
  if (bias.defined()) torch::nn::init::uniform_(bias, -bound, bound);
}

at::Tensor LinearImpl::forward(const at::Tensor& input) {
  auto x = run_input_hooks(input);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "nn::Linear: expected input [..., ",
              weight.size(1), "], got ", x.sizes());
  const auto& kernel = forward_kernel();
  const auto w = parameter("weight", weight), b = parameter("bias", bias);
  auto y = kernel ? kernel->forward(x, w, b) : nn::linear(x, w, b);
  return run_output_hooks(y);
}

void LinearImpl::pretty_print(std::ostream& stream) const {
  stream << "hyper_parallel::nn::Linear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << (options.bias() ? "true" : "false");
  print_parallel_state(stream);
  stream << ")";
}

}  // namespace hyper_parallel::nn
