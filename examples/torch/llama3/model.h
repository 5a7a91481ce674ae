#pragma once
// Llama 3 (decoder-only transformer): RMSNorm, rotary position embedding, grouped-query causal
// attention, SwiGLU feed-forward. A plain model: it knows nothing of parallelism. It is built
// from this library's nn modules, whose hook points (nn::HookableModule) the plan in
// parallelize.h fills.
// Head counts are read from tensor shapes, so the same code runs on sharded weights.

#include <string>
#include <vector>

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <hyper_parallel/core/nn.h>

namespace llama3 {

struct ModelArgs {
  int64_t dim = 256;
  int64_t n_layers = 2;
  int64_t n_heads = 8;
  int64_t n_kv_heads = 4;
  int64_t vocab_size = 1024;
  int64_t multiple_of = 256;
  double ffn_dim_multiplier = 1.5;
  double norm_eps = 1e-5;
  double rope_theta = 500000.0;
  int64_t max_seq_len = 64;

  int64_t head_dim() const { return dim / n_heads; }
  /// SwiGLU hidden size, as in Llama: 2/3 of 4*dim, times the multiplier, rounded up.
  int64_t ffn_hidden_dim() const;

  /// dim 256, 2 layers, 8 heads / 4 kv heads, FFN hidden 1024, vocab 1024, seq 64.
  static ModelArgs debug();
  /// The layer shapes of Llama 3 8B (dim 4096, 32/8 heads, FFN hidden 14336, vocab 128256),
  /// with `n_layers` layers (for benchmarks).
  static ModelArgs llama3_8b(int64_t n_layers = 32);
  /// The transformer of PyTorch's tensor-parallel test checklist: dim 16, 2 layers, 4 heads,
  /// vocab 8, seq 8 (FFN hidden 48).
  static ModelArgs tiny();
  /// A model sized for CPU benchmarks: dim 1024, 2 layers, 8 heads, FFN hidden 2816, vocab 4096,
  /// seq 256.
  static ModelArgs bench();
  /// The smallest Llama here whose every Linear meets the MC2 contract at TP 2 and 4 (k and
  /// n_local >= 256): dim 1024, 1 layer, 8 heads / 8 kv heads, FFN hidden 2816, vocab 2048,
  /// seq 64.
  static ModelArgs small();
  static ModelArgs from_preset(const std::string& name);
};

class AttentionImpl : public torch::nn::Cloneable<AttentionImpl>, public hyper_parallel::nn::HookableModule {
 public:
  explicit AttentionImpl(const ModelArgs& args);
  void reset() override;
  /// x [B, S, dim] -> [B, S, dim], causal.
  at::Tensor forward(const at::Tensor& x);

  ModelArgs args;
  hyper_parallel::nn::Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};
  at::Tensor rope_cos, rope_sin;  // [max_seq_len, head_dim / 2]
};
TORCH_MODULE(Attention);

class FeedForwardImpl : public torch::nn::Cloneable<FeedForwardImpl>,
                        public hyper_parallel::nn::HookableModule {
 public:
  FeedForwardImpl(int64_t dim, int64_t hidden_dim);
  void reset() override;
  /// w2(silu(w1(x)) * w3(x))
  at::Tensor forward(const at::Tensor& x);

  int64_t dim, hidden_dim;
  hyper_parallel::nn::Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
};
TORCH_MODULE(FeedForward);

class TransformerBlockImpl : public torch::nn::Cloneable<TransformerBlockImpl> {
 public:
  explicit TransformerBlockImpl(const ModelArgs& args);
  void reset() override;
  at::Tensor forward(const at::Tensor& x);

  ModelArgs args;
  hyper_parallel::nn::RMSNorm attention_norm{nullptr}, ffn_norm{nullptr};
  Attention attention{nullptr};
  FeedForward feed_forward{nullptr};
};
TORCH_MODULE(TransformerBlock);

class TransformerImpl : public torch::nn::Cloneable<TransformerImpl> {
 public:
  explicit TransformerImpl(const ModelArgs& args);
  void reset() override;
  /// tokens [B, S] (int64) -> logits [B, S, vocab] (or this rank's vocabulary shard under loss
  /// parallel).
  at::Tensor forward(const at::Tensor& tokens);

  ModelArgs args;
  hyper_parallel::nn::Embedding tok_embeddings{nullptr};
  torch::nn::ModuleList layers{nullptr};
  hyper_parallel::nn::RMSNorm norm{nullptr};
  hyper_parallel::nn::Linear output{nullptr};
};
TORCH_MODULE(Transformer);

}  // namespace llama3
