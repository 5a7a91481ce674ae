// nn::Linear, nn::Embedding, nn::RMSNorm. Each forward runs the hook points a style may have
// filled: input hooks, then the forward kernel if one is installed, then output hooks.
#include <cmath>

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <hyper_parallel/nn/embedding.h>
#include <hyper_parallel/nn/linear.h>
#include <hyper_parallel/nn/rms_norm.h>

namespace hyper_parallel::nn {

LinearImpl::LinearImpl(const LinearOptions& options_) : options(options_) {
  TORCH_CHECK(options.in_features() >= 1 && options.out_features() >= 1,
              "nn::Linear: expected positive in_features and out_features, got ",
              options.in_features(), " and ", options.out_features());
  reset();
}

void LinearImpl::reset() {
  weight = register_parameter("weight", at::empty({options.out_features(), options.in_features()}));
  bias = options.bias() ? register_parameter("bias", at::empty({options.out_features()}))
                        : at::Tensor();
  const double bound = 1.0 / std::sqrt(static_cast<double>(options.in_features()));
  torch::nn::init::uniform_(weight, -bound, bound);
  if (bias.defined()) torch::nn::init::uniform_(bias, -bound, bound);
}

at::Tensor LinearImpl::forward(const at::Tensor& input) {
  auto x = run_input_hooks(input);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "nn::Linear: expected input [..., ",
              weight.size(1), "], got ", x.sizes());
  const auto& kernel = forward_kernel();
  auto y = kernel ? kernel->forward(x, weight, bias) : at::linear(x, weight, bias);
  return run_output_hooks(y);
}

void LinearImpl::pretty_print(std::ostream& stream) const {
  stream << "hyper_parallel::nn::Linear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << (options.bias() ? "true" : "false");
  print_parallel_state(stream);
  stream << ")";
}

EmbeddingImpl::EmbeddingImpl(const EmbeddingOptions& options_) : options(options_) {
  TORCH_CHECK(options.num_embeddings() >= 1 && options.embedding_dim() >= 1,
              "nn::Embedding: expected positive num_embeddings and embedding_dim, got ",
              options.num_embeddings(), " and ", options.embedding_dim());
  reset();
}

void EmbeddingImpl::reset() {
  weight = register_parameter("weight", at::empty({options.num_embeddings(), options.embedding_dim()}));
  torch::nn::init::normal_(weight);
}

at::Tensor EmbeddingImpl::forward(const at::Tensor& input) {
  auto ids = run_input_hooks(input);
  TORCH_CHECK(!at::isFloatingType(ids.scalar_type()), "nn::Embedding: expected integer ids, got ",
              ids.scalar_type());
  const auto& kernel = forward_kernel();
  auto y = kernel ? kernel->forward(ids, weight, at::Tensor()) : at::embedding(weight, ids);
  return run_output_hooks(y);
}

void EmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "hyper_parallel::nn::Embedding(num_embeddings=" << options.num_embeddings()
         << ", embedding_dim=" << options.embedding_dim();
  print_parallel_state(stream);
  stream << ")";
}

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
  return run_output_hooks(normed.to(x.scalar_type()) * weight);
}

void RMSNormImpl::pretty_print(std::ostream& stream) const {
  stream << "hyper_parallel::nn::RMSNorm(dim=" << options.dim() << ", eps=" << options.eps();
  print_parallel_state(stream);
  stream << ")";
}

}  // namespace hyper_parallel::nn
