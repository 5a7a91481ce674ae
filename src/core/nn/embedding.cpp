#include <hyper_parallel/core/nn/embedding.h>

#include <ATen/ATen.h>
#include <torch/nn/init.h>

namespace hyper_parallel::nn {

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
  const auto w = parameter("weight", weight);
  auto y = kernel ? kernel->forward(ids, w, at::Tensor()) : at::embedding(w, ids);
  return run_output_hooks(y);
}

void EmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "hyper_parallel::nn::Embedding(num_embeddings=" << options.num_embeddings()
         << ", embedding_dim=" << options.embedding_dim();
  print_parallel_state(stream);
  stream << ")";
}

}  // namespace hyper_parallel::nn
