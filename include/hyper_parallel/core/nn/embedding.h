#pragma once
// nn::Embedding: a lookup table, with hook points so parallel styles can shard it.

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <hyper_parallel/core/nn/hookable_module.h>

namespace hyper_parallel::nn {

/// Usage:
///   Embedding tok(EmbeddingOptions(32000, 256));
struct EmbeddingOptions {
  EmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  TORCH_ARG(int64_t, num_embeddings);
  TORCH_ARG(int64_t, embedding_dim);
};

class EmbeddingImpl : public torch::nn::Cloneable<EmbeddingImpl>, public HookableModule {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim)
      : EmbeddingImpl(EmbeddingOptions(num_embeddings, embedding_dim)) {}
  explicit EmbeddingImpl(const EmbeddingOptions& options);

  /// Parameters as torch.nn.Embedding: normal(0, 1).
  void reset() override;
  /// Integer ids [...] -> [..., embedding_dim].
  at::Tensor forward(const at::Tensor& ids);
  ModuleKind module_kind() const override { return ModuleKind::kEmbedding; }
  void pretty_print(std::ostream& stream) const override;

  EmbeddingOptions options;
  at::Tensor weight;  // [num_embeddings, embedding_dim]
};
TORCH_MODULE(Embedding);

}  // namespace hyper_parallel::nn
