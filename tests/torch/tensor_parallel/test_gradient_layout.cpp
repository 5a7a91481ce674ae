// The contracts of every backward the library writes:
// - layout (core/autograd/gradient_layout.h): each gradient a custom op hands back to autograd
//   has the memory layout of the forward input it belongs to, and fused outputs are laid out as
//   the unfused op's. Checked per op, for batch-first [B, S, H] and sequence-first [S, B, H]
//   activations, at world sizes 1, 2 and 4. The gradients are read where autograd hands them on
//   (a hook on a non-leaf input, on a parameter before its accumulation), not from .grad, which
//   AccumulateGrad re-lays out;
// - saved inputs: a tensor a backward reads, changed in place after the forward, is an error
//   naming the op, as for torch's own ops, not a gradient computed from the new values.
#include <gtest/gtest.h>

#include <functional>

#include <ATen/ATen.h>

#include <hyper_parallel/hyper_parallel.h>

#include "common/test_util.h"

namespace hp = hyper_parallel;
namespace tp = hp::tensor_parallel;
using namespace hp::dtensor;

namespace {

const int64_t kBatch = 3, kK = 256, kHidden = 512;

// The gradient autograd hands on for `t` (a non-leaf or a parameter), as its consumer returned it.
struct GradProbe {
  std::shared_ptr<at::Tensor> seen = std::make_shared<at::Tensor>();
  void watch(const at::Tensor& t) {
    t.register_hook([seen = seen](const at::Tensor& g) { *seen = g; });
  }
  const at::Tensor& grad() const { return *seen; }
};

// `t`'s layout equals `like`'s: sizes and every stride of a dim longer than 1.
void expect_layout_of(const at::Tensor& t, const at::Tensor& like, const std::string& what) {
  ASSERT_TRUE(t.defined()) << what << ": no gradient reached the probe";
  ASSERT_EQ(t.sizes(), like.sizes()) << what;
  for (int64_t d = 0; d < like.dim(); ++d) {
    if (like.size(d) == 1) continue;
    EXPECT_EQ(t.stride(d), like.stride(d))
        << what << ": strides " << t.strides() << ", expected " << like.strides() << " (the input's)";
  }
}

struct Layout {
  const char* name;
  int64_t seq_dim;  // 1: batch-first [B, S, H]; 0: sequence-first [S, B, H]
};
const Layout kLayouts[] = {{"batch_first", 1}, {"sequence_first", 0}};
void PrintTo(const Layout& layout, std::ostream* os) { *os << layout.name; }

// An activation of `local_seq` tokens per rank in `layout`, as a non-leaf (so a probe sees what
// the consumer hands back), contiguous.
at::Tensor activation(const Layout& layout, int64_t local_seq, int64_t features, at::ScalarType dtype) {
  auto shape = layout.seq_dim == 1 ? std::vector<int64_t>{kBatch, local_seq, features}
                                   : std::vector<int64_t>{local_seq, kBatch, features};
  return (at::randn(shape).to(dtype).requires_grad_(true) * 1);
}

tp::MC2Contract contract() { return tp::MC2Contract::relaxed(); }

hp::nn::Linear seeded_linear(int64_t in, int64_t out, uint64_t seed) {
  at::manual_seed(seed);
  hp::nn::Linear l(in, out);
  l->to(at::kBFloat16);
  return l;
}

DeviceMesh mesh() { return init_device_mesh("cpu", {hp_test::world_size()}, {"tp"}); }

class GradientLayout : public ::testing::TestWithParam<Layout> {};

TEST_P(GradientLayout, MC2ColumnAndRowHandBackTheirInputsLayout) {
  const auto layout = GetParam();
  const int64_t p = hp_test::world_size();
  for (bool defer : {true, false}) {
    SCOPED_TRACE(defer ? "deferred weight grads" : "serial weight grads");
    const auto options = tp::MC2Options().defer_weight_grads(defer);
    auto up = seeded_linear(kK, kHidden, 1), down = seeded_linear(kHidden, kK, 2);
    auto m = mesh();
    tp::parallelize_module(*up, m,
                           tp::MC2ColwiseParallel(tp::MC2ColwiseParallelOptions()
                                                      .input_layouts(Shard(layout.seq_dim))
                                                      .contract(contract())
                                                      .mc2_options(options)));
    tp::parallelize_module(*down, m,
                           tp::MC2RowwiseParallel(tp::MC2RowwiseParallelOptions()
                                                      .output_layouts(Shard(layout.seq_dim))
                                                      .contract(contract())
                                                      .mc2_options(options)));
    at::manual_seed(3);
    auto x = activation(layout, 2, kK, at::kBFloat16);
    GradProbe x_probe, h_probe, up_w, down_w;
    x_probe.watch(x);
    up_w.watch(up->weight);
    down_w.watch(down->weight);
    auto h = up(x);
    h_probe.watch(h);
    auto y = down(h);
    // Fused outputs laid out as the unfused Linear's: contiguous.
    EXPECT_TRUE(h.is_contiguous()) << "column output strides " << h.strides();
    EXPECT_TRUE(y.is_contiguous()) << "row output strides " << y.strides();
    EXPECT_EQ(h.size(layout.seq_dim), 2 * p);
    y.backward(at::randn_like(y));
    expect_layout_of(h_probe.grad(), h, "row input gradient");
    expect_layout_of(x_probe.grad(), x, "column input gradient");
    expect_layout_of(up_w.grad(), up->weight, "column weight gradient");
    expect_layout_of(down_w.grad(), down->weight, "row weight gradient");
  }
}

TEST_P(GradientLayout, SharedGatherHandsBackItsInputsLayout) {
  const auto layout = GetParam();
  auto a = seeded_linear(kK, kHidden, 4), b = seeded_linear(kK, kHidden, 5);
  auto m = mesh();
  const auto style = tp::MC2ColwiseParallel(
      tp::MC2ColwiseParallelOptions().input_layouts(Shard(layout.seq_dim)).contract(contract()));
  tp::parallelize_module(*a, m, style);
  tp::parallelize_module(*b, m, style);
  at::manual_seed(6);
  auto x = activation(layout, 2, kK, at::kBFloat16);
  GradProbe x_probe, b_w;
  x_probe.watch(x);
  b_w.watch(b->weight);
  hp::comm::reset_collective_counts();
  auto y = at::silu(a(x)) * b(x);  // b reads the gather a made
  EXPECT_EQ(hp::comm::collective_count(tp::kAllGatherMatmulKind), 1);
  y.backward(at::randn_like(y));
  expect_layout_of(x_probe.grad(), x, "shared gather's input gradient");
  expect_layout_of(b_w.grad(), b->weight, "shared layer's weight gradient");
}

TEST_P(GradientLayout, PlainStylesHandBackTheirInputsLayout) {
  const auto layout = GetParam();
  auto up = seeded_linear(kK, kHidden, 7), down = seeded_linear(kHidden, kK, 8);
  auto m = mesh();
  tp::parallelize_module(
      *up, m, tp::ColwiseParallel(tp::ColwiseParallelOptions().input_layouts(Shard(layout.seq_dim))));
  tp::parallelize_module(
      *down, m, tp::RowwiseParallel(tp::RowwiseParallelOptions().output_layouts(Shard(layout.seq_dim))));
  at::manual_seed(9);
  auto x = activation(layout, 2, kK, at::kBFloat16);
  GradProbe x_probe, h_probe;
  x_probe.watch(x);
  auto h = up(x);
  h_probe.watch(h);
  auto y = down(h);
  EXPECT_TRUE(y.is_contiguous()) << "row output strides " << y.strides();
  y.backward(at::randn_like(y));
  expect_layout_of(h_probe.grad(), h, "row input gradient");
  expect_layout_of(x_probe.grad(), x, "column input gradient");
}

TEST_P(GradientLayout, RedistributeHandsBackItsInputsLayout) {
  const auto layout = GetParam();
  const int64_t s = layout.seq_dim;
  auto m = mesh();
  struct Case {
    const char* name;
    Placement from, to;
  };
  const Case cases[] = {{"Shard(seq) -> Replicate", Shard(s), Replicate()},
                        {"Replicate -> Shard(seq)", Replicate(), Shard(s)},
                        {"Shard(seq) -> Shard(-1)", Shard(s), Shard(-1)},
                        {"Partial -> Shard(seq)", Partial(), Shard(s)},
                        {"Partial -> Replicate", Partial(), Replicate()}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    at::manual_seed(10);
    auto x = activation(layout, 2 * hp_test::world_size(), 4 * hp_test::world_size(), at::kFloat);
    GradProbe probe;
    probe.watch(x);
    auto out = DTensor::from_local(x, m, {c.from}).redistribute({c.to}).to_local();
    EXPECT_TRUE(out.is_contiguous()) << "output strides " << out.strides();
    out.backward(at::randn_like(out));
    expect_layout_of(probe.grad(), x, "input gradient");
  }
}

TEST_P(GradientLayout, LossParallelHandsBackTheLogitsLayout) {
  const auto layout = GetParam();
  const int64_t p = hp_test::world_size(), vocab = 8 * p + 3;  // uneven vocabulary shards
  auto m = mesh();
  at::manual_seed(11);
  auto local_vocab = hp::comm::chunk_size(vocab, p, hp_test::rank());
  auto logits = activation(layout, 5, local_vocab, at::kBFloat16);
  auto targets = layout.seq_dim == 1 ? at::randint(vocab, {kBatch, 5}) : at::randint(vocab, {5, kBatch});
  GradProbe probe;
  probe.watch(logits);
  tp::vocab_parallel_cross_entropy(logits, targets, vocab, m).backward();
  expect_layout_of(probe.grad(), logits, "logits gradient");
}

TEST_P(GradientLayout, SequenceParallelNormHandsBackItsInputsLayout) {
  const auto layout = GetParam();
  at::manual_seed(12);
  hp::nn::RMSNorm norm(kK);
  auto m = mesh();
  tp::parallelize_module(*norm, m,
                         tp::SequenceParallel(tp::SequenceParallelOptions().sequence_dim(layout.seq_dim)));
  auto x = activation(layout, 2, kK, at::kFloat);
  GradProbe x_probe, w_probe;
  x_probe.watch(x);
  w_probe.watch(norm->weight);
  auto y = norm(x);
  y.backward(at::randn_like(y));
  expect_layout_of(x_probe.grad(), x, "norm input gradient");
  expect_layout_of(w_probe.grad(), norm->weight, "norm weight gradient (summed over the mesh)");
  expect_layout_of(norm->weight.grad(), norm->weight, "norm weight .grad");
}

TEST_P(GradientLayout, SequenceHelpersHandBackTheirInputsLayout) {
  const auto layout = GetParam();
  at::manual_seed(13);
  auto x = activation(layout, 4, 16, at::kFloat);
  GradProbe probe;
  probe.watch(x);
  auto rows = tp::sequence_rows(x, layout.seq_dim);
  EXPECT_TRUE(rows.is_contiguous());
  auto back = tp::from_sequence_rows(rows * 2, x, layout.seq_dim, x.size(layout.seq_dim));
  EXPECT_TRUE(back.is_contiguous());
  EXPECT_TRUE(back.equal(x * 2));
  back.backward(at::ones_like(back));
  expect_layout_of(probe.grad(), x, "sequence_rows input gradient");
}

INSTANTIATE_TEST_SUITE_P(Layouts, GradientLayout, ::testing::ValuesIn(kLayouts),
                         [](const auto& info) { return std::string(info.param.name); });

// An MC2 Linear reads its saved input and weight in backward (the row layer's dW = dY_fullᵀ X,
// the column layer's dW = dYᵀ G and dX = dY W): changed in place after the forward, they are an
// error, with deferred weight gradients and without. Sequence-first activations: the row layer
// then saves its input itself (a batch-first one is copied sequence-major first, and the copy is
// what it saves).
TEST(SavedInputs, AnInPlaceChangeAfterTheForwardIsAnError) {
  for (bool defer : {true, false}) {
    SCOPED_TRACE(defer ? "deferred weight grads" : "serial weight grads");
    const auto options = tp::MC2Options().defer_weight_grads(defer);
    auto up = seeded_linear(kK, kHidden, 14), down = seeded_linear(kHidden, kK, 15);
    auto m = mesh();
    tp::parallelize_module(*up, m,
                           tp::MC2ColwiseParallel(tp::MC2ColwiseParallelOptions()
                                                      .input_layouts(Shard(0))
                                                      .contract(contract())
                                                      .mc2_options(options)));
    tp::parallelize_module(*down, m,
                           tp::MC2RowwiseParallel(tp::MC2RowwiseParallelOptions()
                                                      .output_layouts(Shard(0))
                                                      .contract(contract())
                                                      .mc2_options(options)));
    at::manual_seed(16);
    auto x = at::randn({2, kBatch, kK}).to(at::kBFloat16).requires_grad_(true);
    auto h = up(x);
    auto y = down(h);
    h.mul_(2);  // the row layer's saved input
    HP_EXPECT_THROW_MSG(y.sum().backward(),
                        "MC2RowLinearBackward: expected its input saved in forward at version");
    // The weights, as an optimizer step between the forward and the backward would.
    auto y2 = down(up(x));
    {
      at::NoGradGuard no_grad;
      up->weight.mul_(0.5);
    }
    HP_EXPECT_THROW_MSG(y2.sum().backward(), "MC2ColumnLinearBackward: expected its weight saved in forward");
  }
}

// The helper itself: a permuted gradient is copied into the input's strides (dense), a
// non-dense input's gradient is made contiguous, a matching one is passed through untouched.
TEST(GradientLayoutHelper, CopiesOnlyWhenTheStridesDiffer) {
  namespace ag = hp::autograd;
  auto x = at::randn({3, 4, 5});
  auto transposed_grad = at::randn({4, 3, 5}).transpose(0, 1);
  auto fixed = ag::in_layout(transposed_grad, ag::GradientLayout::of(x));
  EXPECT_TRUE(fixed.is_contiguous());
  EXPECT_TRUE(fixed.equal(transposed_grad));
  auto same = at::randn({3, 4, 5});
  EXPECT_TRUE(ag::in_layout(same, ag::GradientLayout::of(x)).is_same(same));
  // A transposed (dense) input: its gradient is transposed too, as PyTorch's mm backward does.
  auto xt = at::randn({5, 4}).t();
  auto g = ag::in_layout(at::randn({4, 5}), ag::GradientLayout::of(xt));
  EXPECT_EQ(g.strides(), xt.strides());
  // A sliced (not dense) input: a contiguous gradient.
  auto sliced = at::randn({4, 10}).narrow(1, 0, 5);
  EXPECT_FALSE(ag::GradientLayout::of(sliced).dense);
  EXPECT_TRUE(ag::in_layout(at::randn({5, 4}).t(), ag::GradientLayout::of(sliced)).is_contiguous());
  EXPECT_FALSE(ag::in_layout(at::Tensor(), ag::GradientLayout::of(x)).defined());
  HP_EXPECT_THROW_MSG(ag::GradientLayout::of({3, 4}, {4}), "expected one stride per dim (2), got 1");
}

}  // namespace
