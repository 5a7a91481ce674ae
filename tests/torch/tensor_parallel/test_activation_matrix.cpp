// What users put around tensor-parallel Linears, through the styles, against a single-process
// float32 reference: forward, input gradient and every weight gradient.
//   between a column and a row layer: exact and tanh GELU, SiLU, SwiGLU, ReLU, tanh, sigmoid,
//     GELU upcast to float32;
//   on the sequence-parallel side (between a row layer and the next column layer): LayerNorm,
//     RMSNorm (SequenceParallel), a residual add, dropout with p = 0;
// for the plain styles and MC2 (deferred weight gradients on and off), batch-first [B, S, H] and
// sequence-first [S, B, H] activations, float32 and bfloat16, at world sizes 2 and 4.
// (A row layer once handed GELU a transposed gradient, which torch 1.13's CPU kernel misreads:
// docs/known-torch-bugs.md.)
#include <gtest/gtest.h>

#include <functional>

#include <ATen/ATen.h>

#include <hyper_parallel/hyper_parallel.h>

#include "common/test_util.h"

namespace hp = hyper_parallel;
namespace tp = hp::tensor_parallel;
using namespace hp::dtensor;

namespace {

const int64_t kBatch = 3, kLocalSeq = 2, kK = 256;

enum class StyleKind { kPlain, kMC2Deferred, kMC2Serial };
const char* name_of(StyleKind s) {
  return s == StyleKind::kPlain ? "plain" : s == StyleKind::kMC2Deferred ? "mc2_deferred" : "mc2_serial";
}

struct Config {
  StyleKind style;
  int64_t seq_dim;  // 1: batch-first; 0: sequence-first
  at::ScalarType dtype;
  std::string str() const {
    return std::string(name_of(style)) + (seq_dim == 1 ? " batch_first " : " sequence_first ") +
           c10::toString(dtype);
  }
};

std::vector<Config> all_configs() {
  std::vector<Config> out;
  for (auto style : {StyleKind::kPlain, StyleKind::kMC2Deferred, StyleKind::kMC2Serial}) {
    for (int64_t seq_dim : {1, 0}) {
      for (auto dtype : {at::kFloat, at::kBFloat16}) out.push_back({style, seq_dim, dtype});
    }
  }
  return out;
}

// ||actual - expected|| / ||expected|| within the dtype's tolerance, everything finite. bf16: 5%,
// since ReLU's mask flips where one rounding more (MC2 adds the bias after the collective, to a
// rounded product) moves a pre-activation across zero: measured up to 3.1% for ReLU, under 2%
// for the smooth activations. A layout or sharding bug is off by orders of magnitude.
void expect_matches(const at::Tensor& actual, const at::Tensor& expected, at::ScalarType dtype,
                    const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what << ": no gradient";
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  auto a = actual.to(at::kDouble), e = expected.to(at::kDouble);
  ASSERT_TRUE(at::isfinite(a).all().item<bool>()) << what << ": not finite";
  const double err = (a - e).norm().item<double>() / std::max(e.norm().item<double>(), 1e-30);
  EXPECT_LT(err, dtype == at::kFloat ? 1e-5 : 5e-2) << what << ": relative error " << err;
}

// A Linear of the model: the full float32 weights (the reference's) and the parallel layer.
struct Layer {
  at::Tensor weight, bias;  // full, float32, rounded through the dtype like the layer's
  hp::nn::Linear module{nullptr};
  bool column = true;
};

Layer make_layer(int64_t in, int64_t out, uint64_t seed, at::ScalarType dtype, bool column) {
  at::manual_seed(seed);
  Layer l;
  l.module = hp::nn::Linear(in, out);
  l.module->to(dtype);
  l.weight = l.module->weight.detach().to(at::kFloat).clone().requires_grad_(true);
  l.bias = l.module->bias.detach().to(at::kFloat).clone().requires_grad_(true);
  l.column = column;
  return l;
}

void parallelize(Layer& l, const Config& c, const DeviceMesh& mesh) {
  const bool mc2 = c.style != StyleKind::kPlain;
  if (!mc2) {
    if (l.column) {
      tp::parallelize_module(
          *l.module, mesh, tp::ColwiseParallel(tp::ColwiseParallelOptions().input_layouts(Shard(c.seq_dim))));
    } else {
      tp::parallelize_module(
          *l.module, mesh,
          tp::RowwiseParallel(tp::RowwiseParallelOptions().output_layouts(Shard(c.seq_dim))));
    }
    return;
  }
  const auto contract = c.dtype == at::kFloat ? tp::MC2Contract::relaxed() : tp::MC2Contract::strict();
  const auto options = tp::MC2Options().defer_weight_grads(c.style == StyleKind::kMC2Deferred);
  if (l.column) {
    tp::parallelize_module(*l.module, mesh,
                           tp::MC2ColwiseParallel(tp::MC2ColwiseParallelOptions()
                                                      .input_layouts(Shard(c.seq_dim))
                                                      .contract(contract)
                                                      .mc2_options(options)));
  } else {
    tp::parallelize_module(*l.module, mesh,
                           tp::MC2RowwiseParallel(tp::MC2RowwiseParallelOptions()
                                                      .output_layouts(Shard(c.seq_dim))
                                                      .contract(contract)
                                                      .mc2_options(options)));
  }
}

// This rank's shard of the reference gradients, compared with the layer's.
void expect_layer_grads(const Layer& l, at::ScalarType dtype, const std::string& what) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  const int64_t d = l.column ? 0 : 1;
  const int64_t n = l.weight.size(d);
  auto w_ref = l.weight.grad().narrow(d, hp::comm::chunk_offset(n, p, r), hp::comm::chunk_size(n, p, r));
  expect_matches(l.module->weight.grad(), w_ref, dtype, what + " weight grad");
  auto b_ref = l.column
                   ? l.bias.grad().narrow(0, hp::comm::chunk_offset(n, p, r), hp::comm::chunk_size(n, p, r))
                   : l.bias.grad();
  expect_matches(l.module->bias.grad(), b_ref, dtype, what + " bias grad");
}

// The full activation [B, S, H] or [S, B, H] of every rank, and this rank's sequence shard.
struct Input {
  at::Tensor full, local;
};
Input make_input(const Config& c, uint64_t seed) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  at::manual_seed(seed);
  auto full =
      c.seq_dim == 1 ? at::randn({kBatch, kLocalSeq * p, kK}) : at::randn({kLocalSeq * p, kBatch, kK});
  full = full.to(c.dtype);
  auto local = full.narrow(c.seq_dim, r * kLocalSeq, kLocalSeq).clone().requires_grad_(true);
  return {full.to(at::kFloat).requires_grad_(true), local};
}

at::Tensor seq_shard(const at::Tensor& full, int64_t seq_dim) {
  return full.narrow(seq_dim, hp_test::rank() * kLocalSeq, kLocalSeq);
}

// ---- Between a column and a row layer ----------------------------------------------------------

struct Activation {
  const char* name;
  std::function<at::Tensor(const at::Tensor& up, const at::Tensor& gate)> apply;
  bool gated = false;  // SwiGLU: silu(up(x)) * gate(x), two column layers reading one activation
};

// ReLU's derivative jumps at 0, so a pre-activation within rounding of 0 flips its mask: a
// float32 reference sum that is exactly 0.0 where MC2's chunked sum gives 3.7e-7 hands one element
// the whole gradient on one side and none on the other (2% of the input gradient's norm, at world
// 4 on an AVX-512 CPU). On both sides h's gradient is scaled by min(|h| / kKinkRamp, 1), which is 0
// at the kink and continuous, so relu's jump there no longer matters, and a rounding difference d
// moves one element's gradient by about d / kKinkRamp (1e-4 of it for d = 1e-6). The forward value
// is h exactly, and relu's own backward still receives the row layer's gradient as that layer
// hands it over.
constexpr double kKinkRamp = 1e-2;
at::Tensor ramp_gradient_near_kink(const at::Tensor& h) {
  const auto scale = (h.detach().abs() / kKinkRamp).clamp_max(1);
  return h.detach() + (h - h.detach()) * scale;
}

std::vector<Activation> activations() {
  return {
      {"gelu", [](const at::Tensor& h, const at::Tensor&) { return at::gelu(h); }},
      {"gelu_tanh", [](const at::Tensor& h, const at::Tensor&) { return at::gelu(h, "tanh"); }},
      {"silu", [](const at::Tensor& h, const at::Tensor&) { return at::silu(h); }},
      {"swiglu", [](const at::Tensor& h, const at::Tensor& g) { return at::silu(h) * g; }, true},
      {"relu", [](const at::Tensor& h, const at::Tensor&) { return at::relu(ramp_gradient_near_kink(h)); }},
      {"tanh", [](const at::Tensor& h, const at::Tensor&) { return at::tanh(h); }},
      {"sigmoid", [](const at::Tensor& h, const at::Tensor&) { return at::sigmoid(h); }},
      {"gelu_fp32_upcast",
       [](const at::Tensor& h, const at::Tensor&) { return at::gelu(h.to(at::kFloat)).to(h.scalar_type()); }},
  };
}

void run_between(const Config& c, const Activation& act) {
  SCOPED_TRACE(c.str() + " " + act.name);
  const int64_t hidden = 256 * hp_test::world_size();  // the strict contract's n_local >= 256
  auto mesh = init_device_mesh("cpu", {hp_test::world_size()}, {"tp"});
  auto up = make_layer(kK, hidden, 21, c.dtype, true);
  auto gate = make_layer(kK, hidden, 22, c.dtype, true);
  auto down = make_layer(hidden, kK, 23, c.dtype, false);
  parallelize(up, c, mesh);
  if (act.gated) parallelize(gate, c, mesh);
  parallelize(down, c, mesh);
  auto in = make_input(c, 24);
  auto y = down.module(act.apply(up.module(in.local), act.gated ? gate.module(in.local) : at::Tensor()));
  auto upstream = at::randn(y.sizes()).to(c.dtype);
  y.backward(upstream);

  // The reference, in float32 on the full sequence, rounded through the dtype where the parallel
  // model's tensors are (so that ReLU's mask sees the same values); its upstream is every rank's.
  const auto round = [&](const at::Tensor& t) { return t.to(c.dtype).to(at::kFloat); };
  const auto f = [&](const Layer& l, const at::Tensor& x) { return round(at::linear(x, l.weight, l.bias)); };
  auto ref = f(down, round(act.apply(f(up, in.full), act.gated ? f(gate, in.full) : at::Tensor())));
  auto full_upstream =
      hp::comm::all_gather(upstream.to(at::kFloat).contiguous(), c.seq_dim, hp::comm::world());
  ref.backward(full_upstream);
  expect_matches(y, seq_shard(ref, c.seq_dim), c.dtype, "output");
  expect_matches(in.local.grad(), seq_shard(in.full.grad(), c.seq_dim), c.dtype, "input grad");
  expect_layer_grads(up, c.dtype, "up");
  if (act.gated) expect_layer_grads(gate, c.dtype, "gate");
  expect_layer_grads(down, c.dtype, "down");
}

TEST(ActivationMatrix, BetweenColumnAndRow) {
  for (const auto& c : all_configs()) {
    for (const auto& act : activations()) run_between(c, act);
  }
}

// ---- On the sequence-parallel side ------------------------------------------------------------

// y = row2(gelu(col2(op(row1(silu(col1(x))), x)))): `op` acts on each rank's tokens.
struct SequenceOp {
  const char* name;
  // (the row output, the block's input) -> the next column's input; `norm` is the test's RMSNorm
  // (SequenceParallel in the parallel model, plain in the reference), `ln` LayerNorm's weight
  // and bias.
  std::function<at::Tensor(const at::Tensor& r, const at::Tensor& x, hp::nn::RMSNorm& norm,
                           const std::vector<at::Tensor>& ln)>
      apply;
};

std::vector<SequenceOp> sequence_ops() {
  return {
      {"layer_norm",
       [](const at::Tensor& r, const at::Tensor&, hp::nn::RMSNorm&, const std::vector<at::Tensor>& ln) {
         return at::layer_norm(r, {r.size(-1)}, ln[0].to(r.scalar_type()), ln[1].to(r.scalar_type()));
       }},
      {"rms_norm", [](const at::Tensor& r, const at::Tensor&, hp::nn::RMSNorm& norm,
                      const std::vector<at::Tensor>&) { return norm(r); }},
      {"residual_add", [](const at::Tensor& r, const at::Tensor& x, hp::nn::RMSNorm&,
                          const std::vector<at::Tensor>&) { return r + x; }},
      {"dropout_p0", [](const at::Tensor& r, const at::Tensor&, hp::nn::RMSNorm&,
                        const std::vector<at::Tensor>&) { return at::dropout(r, 0.0, /*train=*/true); }},
  };
}

std::vector<at::Tensor> layer_norm_params(uint64_t seed) {
  at::manual_seed(seed);
  return {(1 + 0.1 * at::randn({kK})).requires_grad_(true), (0.1 * at::randn({kK})).requires_grad_(true)};
}

void run_sequence_side(const Config& c, const SequenceOp& op) {
  SCOPED_TRACE(c.str() + " " + op.name);
  const int64_t hidden = 256 * hp_test::world_size();
  auto mesh = init_device_mesh("cpu", {hp_test::world_size()}, {"tp"});
  auto col1 = make_layer(kK, hidden, 31, c.dtype, true), row1 = make_layer(hidden, kK, 32, c.dtype, false);
  auto col2 = make_layer(kK, hidden, 33, c.dtype, true), row2 = make_layer(hidden, kK, 34, c.dtype, false);
  for (auto* l : {&col1, &row1, &col2, &row2}) parallelize(*l, c, mesh);
  hp::nn::RMSNorm norm(kK), ref_norm(kK);
  {
    at::NoGradGuard no_grad;
    at::manual_seed(35);
    ref_norm->weight.copy_(1 + 0.1 * at::randn({kK}));
    norm->weight.copy_(ref_norm->weight);
  }
  norm->to(c.dtype);
  tp::parallelize_module(*norm, mesh,
                         tp::SequenceParallel(tp::SequenceParallelOptions().sequence_dim(c.seq_dim)));
  auto ln = layer_norm_params(36), ref_ln = layer_norm_params(36);
  auto in = make_input(c, 37);
  const auto block = [&](const auto& lin, const at::Tensor& x, hp::nn::RMSNorm& n,
                         const std::vector<at::Tensor>& p) {
    return lin(row2, at::gelu(lin(col2, op.apply(lin(row1, at::silu(lin(col1, x))), x, n, p))));
  };
  auto y = block([](Layer& l, const at::Tensor& x) { return l.module(x); }, in.local, norm, ln);
  auto upstream = at::randn(y.sizes()).to(c.dtype);
  y.backward(upstream);
  const auto round = [&](const at::Tensor& t) { return t.to(c.dtype).to(at::kFloat); };
  auto ref =
      block([&](const Layer& l, const at::Tensor& x) { return round(at::linear(x, l.weight, l.bias)); },
            in.full, ref_norm, ref_ln);
  ref.backward(hp::comm::all_gather(upstream.to(at::kFloat).contiguous(), c.seq_dim, hp::comm::world()));

  expect_matches(y, seq_shard(ref, c.seq_dim), c.dtype, "output");
  expect_matches(in.local.grad(), seq_shard(in.full.grad(), c.seq_dim), c.dtype, "input grad");
  for (auto [l, name] : {std::pair{&col1, "col1"}, {&row1, "row1"}, {&col2, "col2"}, {&row2, "row2"}}) {
    expect_layer_grads(*l, c.dtype, name);
  }
  if (std::string(op.name) == "rms_norm") {  // summed over the mesh by SequenceParallel
    expect_matches(norm->weight.grad(), ref_norm->weight.grad(), c.dtype, "RMSNorm weight grad");
  }
  if (std::string(op.name) == "layer_norm") {  // each rank's tokens: summed here
    for (size_t i = 0; i < 2; ++i) {
      auto summed = hp::comm::all_reduce(ln[i].grad(), hp::comm::ReduceOp::kSum, hp::comm::world());
      expect_matches(summed, ref_ln[i].grad(), c.dtype, "LayerNorm param grad");
    }
  }
}

TEST(ActivationMatrix, SequenceParallelSide) {
  for (const auto& c : all_configs()) {
    for (const auto& op : sequence_ops()) run_sequence_side(c, op);
  }
}

}  // namespace
