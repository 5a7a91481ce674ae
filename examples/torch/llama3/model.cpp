#include "model.h"

#include <cmath>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace llama3 {

using hyper_parallel::nn::Embedding;
using hyper_parallel::nn::Linear;
using hyper_parallel::nn::LinearOptions;
using hyper_parallel::nn::RMSNorm;
using hyper_parallel::nn::RMSNormOptions;

int64_t ModelArgs::ffn_hidden_dim() const {
  auto hidden = static_cast<int64_t>(2 * 4 * dim / 3);
  hidden = static_cast<int64_t>(ffn_dim_multiplier * static_cast<double>(hidden));
  return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
}

ModelArgs ModelArgs::debug() { return ModelArgs{}; }

ModelArgs ModelArgs::llama3_8b(int64_t n_layers) {
  ModelArgs a;
  a.dim = 4096;
  a.n_layers = n_layers;
  a.n_heads = 32;
  a.n_kv_heads = 8;
  a.vocab_size = 128256;
  a.multiple_of = 1024;
  a.ffn_dim_multiplier = 1.3;
  a.max_seq_len = 8192;
  return a;
}

ModelArgs ModelArgs::tiny() {
  ModelArgs a;
  a.dim = 16;
  a.n_layers = 2;
  a.n_heads = 4;
  a.n_kv_heads = 4;
  a.vocab_size = 8;
  a.multiple_of = 16;
  a.ffn_dim_multiplier = 1.0;
  a.max_seq_len = 8;
  return a;
}

ModelArgs ModelArgs::bench() {
  ModelArgs a;
  a.dim = 1024;
  a.n_layers = 2;
  a.n_heads = 8;
  a.n_kv_heads = 8;
  a.vocab_size = 4096;
  a.ffn_dim_multiplier = 1.0;
  a.max_seq_len = 256;
  return a;
}

ModelArgs ModelArgs::small() {
  ModelArgs a = bench();
  a.n_layers = 1;
  a.vocab_size = 2048;
  a.max_seq_len = 64;
  return a;
}

ModelArgs ModelArgs::from_preset(const std::string& name) {
  if (name == "debug") return debug();
  if (name == "bench") return bench();
  if (name == "small") return small();
  if (name == "tiny") return tiny();
  if (name == "llama3_8b") return llama3_8b();
  if (name == "llama3_8b_1layer") return llama3_8b(1);
  TORCH_CHECK(false,
              "ModelArgs::from_preset: expected 'debug', 'tiny', 'small', 'bench', 'llama3_8b' or "
              "'llama3_8b_1layer', got '",
              name, "'");
}

namespace {

// Rotary embedding on [B, S, H, head_dim]: rotate each adjacent pair (x0, x1) by angle
// position * theta^(-2i/head_dim).
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto s = x.size(1);
  auto pairs = x.to(at::kFloat).unflatten(-1, {-1, 2});
  auto x0 = pairs.select(-1, 0), x1 = pairs.select(-1, 1);
  auto c = cos.narrow(0, 0, s).unsqueeze(1), sn = sin.narrow(0, 0, s).unsqueeze(1);
  auto out = at::stack({x0 * c - x1 * sn, x0 * sn + x1 * c}, -1).flatten(-2);
  return out.to(x.scalar_type());
}

}  // namespace

AttentionImpl::AttentionImpl(const ModelArgs& args_) : args(args_) {
  TORCH_CHECK(args.dim % args.n_heads == 0, "Attention: expected dim divisible by n_heads, got ", args.dim,
              " and ", args.n_heads);
  TORCH_CHECK(args.n_heads % args.n_kv_heads == 0,
              "Attention: expected n_heads divisible by n_kv_heads, got ", args.n_heads, " and ",
              args.n_kv_heads);
  reset();
}

void AttentionImpl::reset() {
  const int64_t hd = args.head_dim();
  wq = register_module("wq", Linear(LinearOptions(args.dim, args.n_heads * hd).bias(false)));
  wk = register_module("wk", Linear(LinearOptions(args.dim, args.n_kv_heads * hd).bias(false)));
  wv = register_module("wv", Linear(LinearOptions(args.dim, args.n_kv_heads * hd).bias(false)));
  wo = register_module("wo", Linear(LinearOptions(args.n_heads * hd, args.dim).bias(false)));
  auto inv_freq = at::pow(args.rope_theta, -at::arange(0, hd, 2, at::kDouble) / hd);
  auto angles = at::outer(at::arange(args.max_seq_len, at::kDouble), inv_freq).to(at::kFloat);
  rope_cos = register_buffer("rope_cos", angles.cos());
  rope_sin = register_buffer("rope_sin", angles.sin());
}

at::Tensor AttentionImpl::forward(const at::Tensor& input) {
  auto x = run_input_hooks(input);
  TORCH_CHECK(x.dim() == 3, "Attention: expected x [B, S, dim], got ", x.sizes());
  // Batch and sequence come from the projections: they see the whole sequence even when x holds
  // only some of its tokens (a projection may gather them).
  auto q = wq(x), k = wk(x), v = wv(x);
  const int64_t b = q.size(0), s = q.size(1), hd = args.head_dim();
  TORCH_CHECK(s <= args.max_seq_len, "Attention: expected seq_len <= max_seq_len ", args.max_seq_len,
              ", got ", s);
  q = q.view({b, s, -1, hd});
  k = k.view({b, s, -1, hd});
  v = v.view({b, s, -1, hd});
  q = apply_rope(q, rope_cos, rope_sin);
  k = apply_rope(k, rope_cos, rope_sin);
  // Grouped-query attention: each kv head serves n_heads / n_kv_heads query heads.
  const int64_t repeats = q.size(2) / k.size(2);
  k = k.repeat_interleave(repeats, 2);
  v = v.repeat_interleave(repeats, 2);
  q = q.transpose(1, 2);
  k = k.transpose(1, 2);
  v = v.transpose(1, 2);
  auto scores = at::matmul(q, k.transpose(-2, -1)).to(at::kFloat) / std::sqrt(double(hd));
  auto causal = at::ones({s, s}, x.options().dtype(at::kBool)).triu(1);
  auto probs = scores.masked_fill(causal, -INFINITY).softmax(-1).to(x.scalar_type());
  auto out = at::matmul(probs, v).transpose(1, 2).reshape({b, s, -1});
  return run_output_hooks(wo(out));
}

FeedForwardImpl::FeedForwardImpl(int64_t dim_, int64_t hidden_dim_) : dim(dim_), hidden_dim(hidden_dim_) {
  reset();
}

void FeedForwardImpl::reset() {
  w1 = register_module("w1", Linear(LinearOptions(dim, hidden_dim).bias(false)));
  w2 = register_module("w2", Linear(LinearOptions(hidden_dim, dim).bias(false)));
  w3 = register_module("w3", Linear(LinearOptions(dim, hidden_dim).bias(false)));
}

at::Tensor FeedForwardImpl::forward(const at::Tensor& input) {
  auto x = run_input_hooks(input);
  return run_output_hooks(w2(at::silu(w1(x)) * w3(x)));
}

TransformerBlockImpl::TransformerBlockImpl(const ModelArgs& args_) : args(args_) { reset(); }

void TransformerBlockImpl::reset() {
  attention_norm = register_module("attention_norm", RMSNorm(RMSNormOptions(args.dim).eps(args.norm_eps)));
  attention = register_module("attention", Attention(args));
  ffn_norm = register_module("ffn_norm", RMSNorm(RMSNormOptions(args.dim).eps(args.norm_eps)));
  feed_forward = register_module("feed_forward", FeedForward(args.dim, args.ffn_hidden_dim()));
}

at::Tensor TransformerBlockImpl::forward(const at::Tensor& x) {
  auto h = x + attention(attention_norm(x));
  return h + feed_forward(ffn_norm(h));
}

TransformerImpl::TransformerImpl(const ModelArgs& args_) : args(args_) { reset(); }

void TransformerImpl::reset() {
  tok_embeddings = register_module("tok_embeddings", Embedding(args.vocab_size, args.dim));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < args.n_layers; ++i) layers->push_back(TransformerBlock(args));
  norm = register_module("norm", RMSNorm(RMSNormOptions(args.dim).eps(args.norm_eps)));
  output = register_module("output", Linear(LinearOptions(args.dim, args.vocab_size).bias(false)));
}

at::Tensor TransformerImpl::forward(const at::Tensor& tokens) {
  auto h = tok_embeddings(tokens);
  for (size_t i = 0; i < layers->size(); ++i) h = layers->ptr<TransformerBlockImpl>(i)->forward(h);
  return output(norm(h));
}

}  // namespace llama3
