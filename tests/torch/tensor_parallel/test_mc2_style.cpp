// MC2 style and MC2Linear behaviour: conversion in place, configuration, layout validation, path
// selection (which fused op runs, how often) and every fail-closed limit, by message. Runs on 2
// ranks (the smallest world the contract allows).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include <hyper_parallel/hyper_parallel.h>

#include "common/test_util.h"
#include "llama3/parallelize.h"

namespace hp = hyper_parallel;
namespace tp = hp::tensor_parallel;
using namespace hp::dtensor;

namespace {

class MC2Style : public ::testing::Test {
 protected:
  void SetUp() override {
    if (hp_test::world_size() != 2) GTEST_SKIP() << "runs on 2 ranks";
    mesh = init_device_mesh("cpu", {2}, {"tp"});
  }
  static hp::nn::Linear linear(int64_t in, int64_t out, at::ScalarType dtype = at::kBFloat16) {
    at::manual_seed(1);
    hp::nn::Linear l(in, out);
    l->to(dtype);
    return l;
  }
  std::optional<DeviceMesh> mesh;
};

TEST_F(MC2Style, FromLinearKeepsTheObjectAndItsParameters) {
  auto lin = linear(512, 512);
  auto* impl_before = lin.get();
  auto weight_before = lin->weight;
  auto values = lin->weight.detach().clone();
  EXPECT_FALSE(tp::MC2Linear::of(*lin).has_value());
  auto mc2 = tp::MC2Linear::from_linear(*lin);
  EXPECT_EQ(lin.get(), impl_before);
  EXPECT_TRUE(lin->weight.is_same(weight_before));
  EXPECT_TRUE(lin->weight.equal(values));
  EXPECT_EQ(lin->parameters().size(), 2u);
  EXPECT_TRUE(tp::MC2Linear::of(*lin).has_value());
  EXPECT_FALSE(mc2.is_configured());
  // Converting again returns the same MC2 state.
  tp::MC2Linear::from_linear(*lin).configure_mc2(tp::MC2Mode::kAllGather, mesh->get_group(0), 1);
  EXPECT_TRUE(mc2.is_configured());
}

TEST_F(MC2Style, OnlyThisLibrarysLinearConverts) {
  hp::nn::RMSNorm norm(512);
  HP_EXPECT_THROW_MSG(tp::MC2Linear::from_linear(*norm),
                      "MC2Linear::from_linear: expected a hyper_parallel::nn::Linear, got");
  torch::nn::Linear torch_linear(4, 4);
  HP_EXPECT_THROW_MSG(tp::MC2Linear::from_linear(*torch_linear), "expected a hyper_parallel::nn::Linear");
  HP_EXPECT_THROW_MSG(tp::MC2ColwiseParallel().apply(*norm, *mesh),
                      "MC2ColwiseParallel: expected hyper_parallel::nn::Linear, got");
  HP_EXPECT_THROW_MSG(tp::MC2RowwiseParallel().apply(*norm, *mesh),
                      "MC2RowwiseParallel: expected hyper_parallel::nn::Linear");
  auto rowwise = linear(512, 512);
  tp::RowwiseParallel().apply(*rowwise, *mesh);
  HP_EXPECT_THROW_MSG(tp::MC2Linear::from_linear(*rowwise), "already using RowwiseLinear");
}

TEST_F(MC2Style, ConfigureValidatesModeAndWorldSize) {
  auto mc2 = tp::MC2Linear::from_linear(*linear(512, 512));
  auto group = mesh->get_group(0);
  // The mode is typed; its original spelling ("all_gather", "reduce_scatter") maps onto it.
  HP_EXPECT_THROW_MSG(tp::mc2_mode_from_string("all_reduce"),
                      "expected mode 'all_gather' or 'reduce_scatter', got 'all_reduce'");
  EXPECT_EQ(tp::mc2_mode_from_string("all_gather"), tp::MC2Mode::kAllGather);
  EXPECT_STREQ(tp::to_string(tp::MC2Mode::kReduceScatter), "reduce_scatter");
  HP_EXPECT_THROW_MSG(
      mc2.configure_mc2(tp::MC2Mode::kAllGather, group, 1, tp::MC2Contract().world_sizes({4, 8})),
      "MC2 world_size: expected one of [4, 8], got 2");
  HP_EXPECT_THROW_MSG(
      mc2.configure_mc2(tp::MC2Mode::kAllGather, group, 1, {}, tp::MC2Options().chunks_per_rank(-1)),
      "expected chunks_per_rank >= 1, or kAutoChunks (0: chosen per op), got -1");
  EXPECT_FALSE(mc2.is_configured());
  mc2.configure_mc2(tp::MC2Mode::kReduceScatter, group, 0);
  EXPECT_EQ(mc2.mode(), tp::MC2Mode::kReduceScatter);
  EXPECT_EQ(mc2.world_size(), 2);  // the group's size
  EXPECT_EQ(mc2.sequence_dim(), 0);
}

TEST_F(MC2Style, UnconfiguredForwardIsAPlainLinear) {
  auto lin = linear(512, 512);
  const auto x = at::randn({2, 4, 512}, at::kBFloat16);
  const auto plain = lin(x);
  tp::MC2Linear::from_linear(*lin);
  EXPECT_TRUE(lin(x).equal(plain));
}

TEST_F(MC2Style, StylesRequireSequenceParallelLayouts) {
  HP_EXPECT_THROW_MSG(tp::MC2ColwiseParallel(tp::MC2ColwiseParallelOptions().input_layouts(Replicate())),
                      "MC2ColwiseParallel: requires a sharded input layout");
  HP_EXPECT_THROW_MSG(tp::MC2RowwiseParallel(tp::MC2RowwiseParallelOptions().output_layouts(Replicate())),
                      "MC2RowwiseParallel: requires a sharded output layout");
  HP_EXPECT_THROW_MSG(tp::MC2ColwiseParallel(tp::MC2ColwiseParallelOptions().output_layouts(Partial())),
                      "expected output_layouts Shard or Replicate, got Partial(sum)");
  HP_EXPECT_THROW_MSG(tp::MC2ColwiseParallel(tp::MC2ColwiseParallelOptions().input_layouts(Shard(-1))),
                      "MC2ColwiseParallel: expected input_layouts Shard(sequence dim), got Shard(-1)");
  HP_EXPECT_THROW_MSG(tp::MC2RowwiseParallel(tp::MC2RowwiseParallelOptions().output_layouts(Shard(-1))),
                      "MC2RowwiseParallel: expected output_layouts Shard(sequence dim), got Shard(-1)");
}

TEST_F(MC2Style, ApplyYieldsConfiguredMC2LinearsWithPlainShards) {
  auto col = linear(512, 512);
  tp::parallelize_module(*col, *mesh, tp::MC2ColwiseParallel());
  auto c = tp::MC2Linear::of(*col);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->mode(), tp::MC2Mode::kAllGather);
  EXPECT_EQ(c->world_size(), 2);
  EXPECT_EQ(c->sequence_dim(), 1);
  EXPECT_EQ(c->group().global_ranks(), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(col->weight.sizes(), (at::IntArrayRef{256, 512}));  // Shard(0), as ColwiseParallel
  EXPECT_EQ(col->bias.sizes(), (at::IntArrayRef{256}));

  auto row = linear(512, 512);
  tp::parallelize_module(*row, *mesh,
                         tp::MC2RowwiseParallel(tp::MC2RowwiseParallelOptions().output_layouts(Shard(0))));
  auto rw = tp::MC2Linear::of(*row);
  ASSERT_TRUE(rw.has_value());
  EXPECT_EQ(rw->mode(), tp::MC2Mode::kReduceScatter);
  EXPECT_EQ(rw->sequence_dim(), 0);
  EXPECT_EQ(row->weight.sizes(), (at::IntArrayRef{512, 256}));  // Shard(1), as RowwiseParallel
  EXPECT_EQ(row->bias.sizes(), (at::IntArrayRef{512}));
}

TEST_F(MC2Style, ColumnPathRunsOneFusedOpEachWayAndNothingElse) {
  auto col = linear(512, 512);
  tp::parallelize_module(*col, *mesh, tp::MC2ColwiseParallel());
  auto x = at::randn({2, 4, 512}).to(at::kBFloat16).requires_grad_(true);
  hp::comm::reset_collective_counts();
  at::Tensor y;
  {
    hp::comm::CommRegion r("forward");
    y = col(x);
  }
  EXPECT_EQ(y.sizes(), (at::IntArrayRef{2, 8, 256}));
  {
    hp::comm::CommRegion r("backward");
    y.sum().backward();
  }
  EXPECT_EQ(hp::comm::collective_count(tp::kAllGatherMatmulKind, "forward"), 1);
  EXPECT_EQ(hp::comm::total_collective_count("forward"), 1);
  EXPECT_EQ(hp::comm::collective_count(tp::kMatmulReduceScatterKind, "backward"), 1);
  EXPECT_EQ(hp::comm::total_collective_count("backward"), 1) << hp::comm::collective_counts_summary();
}

TEST_F(MC2Style, RowPathRunsOneFusedOpEachWayAndNothingElse) {
  auto row = linear(512, 512);
  tp::parallelize_module(*row, *mesh, tp::MC2RowwiseParallel());
  auto x = at::randn({2, 8, 256}).to(at::kBFloat16).requires_grad_(true);
  hp::comm::reset_collective_counts();
  at::Tensor y;
  {
    hp::comm::CommRegion r("forward");
    y = row(x);
  }
  EXPECT_EQ(y.sizes(), (at::IntArrayRef{2, 4, 512}));
  {
    hp::comm::CommRegion r("backward");
    y.sum().backward();
  }
  EXPECT_EQ(hp::comm::collective_count(tp::kMatmulReduceScatterKind, "forward"), 1);
  EXPECT_EQ(hp::comm::total_collective_count("forward"), 1);
  EXPECT_EQ(hp::comm::collective_count(tp::kAllGatherMatmulKind, "backward"), 1);
  EXPECT_EQ(hp::comm::total_collective_count("backward"), 1);
  EXPECT_EQ(hp::comm::total_collective_count(), 2) << "no gradient sync: the bias gradient is complete";
}

TEST_F(MC2Style, ColumnLayersReadingOneActivationShareOneGather) {
  auto w1 = linear(512, 512), w3 = linear(512, 512), lone = linear(512, 512);
  for (auto* m : {&w1, &w3, &lone}) tp::parallelize_module(**m, *mesh, tp::MC2ColwiseParallel());
  auto x = at::randn({2, 4, 512}).to(at::kBFloat16).requires_grad_(true);
  hp::comm::reset_collective_counts();
  at::Tensor y1, y3;
  {
    hp::comm::CommRegion r("forward");
    y1 = w1(x);
    y3 = w3(x);  // same activation: reuses w1's gather
  }
  EXPECT_EQ(hp::comm::total_collective_count("forward"), 1);
  {
    hp::comm::CommRegion r("backward");
    (y1 + y3).sum().backward();
  }
  // One fused ring for both layers' input gradient: reduce_scatter(dY1 W1 + dY3 W3).
  EXPECT_EQ(hp::comm::collective_count(tp::kMatmulReduceScatterKind, "backward"), 1);
  EXPECT_EQ(hp::comm::total_collective_count("backward"), 1);
  // Same values and input gradient as gathering separately (a copy is another activation).
  auto x3 = x.detach().clone().requires_grad_(true);
  auto y3_alone = w3(x3);
  EXPECT_TRUE(y3_alone.equal(y3));
  auto x1 = x.detach().clone().requires_grad_(true);
  (w1(x1) + 0).sum().backward();
  y3_alone.sum().backward();
  hp_test::expect_close(x.grad(), (x1.grad().to(at::kFloat) + x3.grad().to(at::kFloat)),
                        "shared-gather input gradient");
  // A layer called again on the same activation (a new pass) gathers afresh, and both passes
  // backpropagate through their own gathers.
  hp::comm::reset_collective_counts();
  auto xa = at::randn({2, 4, 512}).to(at::kBFloat16).requires_grad_(true);
  auto first = w1(xa);
  auto second = w1(xa);
  EXPECT_EQ(hp::comm::collective_count(tp::kAllGatherMatmulKind), 2);
  first.sum().backward();
  second.sum().backward();
  EXPECT_TRUE(first.equal(second));
  // An in-place change of the activation (new version) means a fresh gather.
  auto z = at::randn({2, 4, 512}).to(at::kBFloat16);
  hp::comm::reset_collective_counts();
  lone(z);
  {
    at::NoGradGuard g;
    z.mul_(2);
  }
  lone(z);
  EXPECT_EQ(hp::comm::collective_count(tp::kAllGatherMatmulKind), 2);
}

TEST_F(MC2Style, SequenceRowsRoundTripAndTheNaiveFlattenCounterexample) {
  auto x = at::arange(2 * 3 * 4, at::kFloat).reshape({2, 3, 4});  // [B, S, H]
  auto rows = tp::sequence_rows(x, 1);
  EXPECT_EQ(rows.sizes(), (at::IntArrayRef{6, 4}));
  // Row i*B + b is token i of batch row b: sequence-major.
  EXPECT_TRUE(rows[1].equal(x[1][0]));
  EXPECT_TRUE(tp::from_sequence_rows(rows, x, 1, 3).equal(x));
  HP_EXPECT_THROW_MSG(tp::sequence_rows(x, 2), "expected sequence_dim to be a non-feature dim");

  // Two ranks each hold S/2 tokens of [B, S, H]. Gathering sequence-major rows and restoring
  // gives the full tensor; gathering naively flattened rows ([B*S/2, H], batch-major) and
  // reshaping interleaves tokens of different batch rows.
  auto full = at::arange(2 * 4 * 3, at::kFloat).reshape({2, 4, 3});
  auto shard0 = full.narrow(1, 0, 2), shard1 = full.narrow(1, 2, 2);
  auto gathered = at::cat({tp::sequence_rows(shard0, 1), tp::sequence_rows(shard1, 1)});
  EXPECT_TRUE(tp::from_sequence_rows(gathered, shard0, 1, 4).equal(full));
  auto naive = at::cat({shard0.reshape({-1, 3}), shard1.reshape({-1, 3})}).reshape({2, 4, 3});
  EXPECT_FALSE(naive.equal(full));
}

TEST_F(MC2Style, FailsClosedOnEveryContractLimit) {
  // dtype: when the layer runs, naming it (a cast after apply changes it)
  auto fp32 = linear(512, 512, at::kFloat);
  tp::parallelize_module(*fp32, *mesh, {{"", std::make_shared<tp::MC2ColwiseParallel>()}});
  HP_EXPECT_THROW_MSG(
      fp32(at::ones({2, 4, 512})),
      "MC2Linear(the root module)::forward: MC2 dtype: expected one of {Half, BFloat16}, got Float");
  // k
  HP_EXPECT_THROW_MSG(tp::MC2ColwiseParallel().apply(*linear(128, 512), *mesh),
                      "MC2 contraction dim k (in_features): expected in [256, 65535), got 128");
  HP_EXPECT_THROW_MSG(tp::MC2ColwiseParallel().apply(*linear(65536, 512), *mesh),
                      "expected in [256, 65535), got 65536");
  // column backward n_local = 256 / 2
  HP_EXPECT_THROW_MSG(tp::MC2ColwiseParallel().apply(*linear(512, 256), *mesh),
                      "column backward contraction n_local (out_features / world_size): expected in "
                      "[256, 65535), got 128");
  // row k_local = 256 / 2
  HP_EXPECT_THROW_MSG(tp::MC2RowwiseParallel().apply(*linear(256, 512), *mesh),
                      "MC2RowwiseParallel: MC2 contraction dim k (in_features / world_size): expected "
                      "in [256, 65535), got 128");
  // world size
  HP_EXPECT_THROW_MSG(
      tp::MC2RowwiseParallel(tp::MC2RowwiseParallelOptions().contract(tp::MC2Contract().world_sizes({4, 8})))
          .apply(*linear(1024, 512), *mesh),
      "MC2 world_size: expected one of [4, 8], got 2");
  // rows divisible by world size (known at forward only)
  auto row = linear(512, 512);
  tp::parallelize_module(*row, *mesh, tp::MC2RowwiseParallel());
  HP_EXPECT_THROW_MSG(
      row(at::ones({2, 7, 256}, at::kBFloat16)),
      "reduce_scatter needs the sequence length (dim 1 of [2, 7, 256]) divisible by world_size 2");
  // input dtype at forward
  HP_EXPECT_THROW_MSG(row(at::ones({2, 8, 256}, at::kFloat)),
                      "MC2Linear(the root module)::forward: MC2 dtype");
  // The relaxed contract is explicit and runs the fused path in float32.
  auto relaxed = linear(16, 16, at::kFloat);
  tp::parallelize_module(
      *relaxed, *mesh,
      tp::MC2ColwiseParallel(tp::MC2ColwiseParallelOptions().contract(tp::MC2Contract::relaxed())));
  hp::comm::reset_collective_counts();
  EXPECT_EQ(relaxed(at::ones({1, 2, 16})).sizes(), (at::IntArrayRef{1, 4, 8}));
  EXPECT_EQ(hp::comm::collective_count(tp::kAllGatherMatmulKind), 1);
}

// Each shape limit of the kernel contract, forward and backward, for both styles, at apply time
// (a cast cannot change them; the dtype limit is checked when the layer runs).
TEST_F(MC2Style, EveryContractLimitIsCheckedAtApplyTimeForBothStyles) {
  struct Case {
    const char* what;
    int64_t in, out;
    at::ScalarType dtype;
    bool column;
    const char* message;
  };
  const Case cases[] = {
      {"column forward k = in_features", 128, 512, at::kBFloat16, true,
       "MC2ColwiseParallel: MC2 contraction dim k (in_features): expected in [256, 65535), got 128"},
      {"column forward k upper bound", 65535, 512, at::kBFloat16, true,
       "MC2ColwiseParallel: MC2 contraction dim k (in_features): expected in [256, 65535), got 65535"},
      {"column backward n_local = out_features / P", 512, 256, at::kBFloat16, true,
       "MC2ColwiseParallel: MC2 column backward contraction n_local (out_features / world_size): "
       "expected in [256, 65535), got 128"},
      {"row forward k_local = in_features / P", 256, 512, at::kBFloat16, false,
       "MC2RowwiseParallel: MC2 contraction dim k (in_features / world_size): expected in [256, "
       "65535), got 128"},
      {"row backward n = out_features", 1024, 128, at::kBFloat16, false,
       "MC2RowwiseParallel: MC2 row backward contraction n (out_features): expected in [256, "
       "65535), got 128"},
      {"row backward n upper bound", 1024, 65535, at::kBFloat16, false,
       "MC2RowwiseParallel: MC2 row backward contraction n (out_features): expected in [256, "
       "65535), got 65535"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    auto lin = linear(c.in, c.out, c.dtype);
    auto weight = lin->weight.detach().clone();
    if (c.column) {
      HP_EXPECT_THROW_MSG(tp::MC2ColwiseParallel().apply(*lin, *mesh), c.message);
    } else {
      HP_EXPECT_THROW_MSG(tp::MC2RowwiseParallel().apply(*lin, *mesh), c.message);
    }
    // Nothing was touched: the weight is whole and the forward is the plain one.
    EXPECT_TRUE(lin->weight.equal(weight));
    EXPECT_FALSE(tp::MC2Linear::of(*lin).has_value());
  }
  // World size, for both styles.
  const auto only_4_8 = tp::MC2Contract().world_sizes({4, 8});
  HP_EXPECT_THROW_MSG(tp::MC2ColwiseParallel(tp::MC2ColwiseParallelOptions().contract(only_4_8))
                          .apply(*linear(512, 1024), *mesh),
                      "MC2ColwiseParallel: MC2 world_size: expected one of [4, 8], got 2");
  HP_EXPECT_THROW_MSG(tp::MC2RowwiseParallel(tp::MC2RowwiseParallelOptions().contract(only_4_8))
                          .apply(*linear(1024, 512), *mesh),
                      "MC2RowwiseParallel: MC2 world_size: expected one of [4, 8], got 2");
}

// An MLP whose Linears are children "up" and "down" (their paths name them in errors).
struct TwoLayerMLP : torch::nn::Module {
  explicit TwoLayerMLP(at::ScalarType dtype) {
    at::manual_seed(2);
    up = register_module("up", hp::nn::Linear(512, 1024));
    down = register_module("down", hp::nn::Linear(1024, 512));
    to(dtype);
  }
  void parallelize(const DeviceMesh& mesh) {
    tp::parallelize_module(*this, mesh,
                           {{"up", std::make_shared<tp::MC2ColwiseParallel>()},
                            {"down", std::make_shared<tp::MC2RowwiseParallel>()}});
  }
  at::Tensor forward(const at::Tensor& x) { return down(at::silu(up(x))); }
  hp::nn::Linear up{nullptr}, down{nullptr};
};

// PyTorch users often parallelize in float32, then cast the model: the kernel's dtype limit is
// checked when a layer runs (naming it), so that order works, and gives the bits of a model
// parallelized in bfloat16.
TEST_F(MC2Style, ParallelizedInFloat32ThenCastToBfloat16Runs) {
  TwoLayerMLP cast_after(at::kFloat), bf16(at::kBFloat16);
  cast_after.parallelize(*mesh);
  bf16.parallelize(*mesh);
  at::manual_seed(3);
  auto x = at::randn({2, 4, 512});
  HP_EXPECT_THROW_MSG(cast_after.forward(x),
                      "MC2Linear(up)::forward: MC2 dtype: expected one of {Half, BFloat16}, got Float");
  cast_after.to(at::kBFloat16);
  auto y = cast_after.forward(x.to(at::kBFloat16));
  EXPECT_TRUE(y.equal(bf16.forward(x.to(at::kBFloat16))));
  y.sum().backward();
  EXPECT_EQ(cast_after.up->weight.grad().scalar_type(), at::kBFloat16);
  // Cast back to float32: the next forward names the layer again.
  cast_after.to(at::kFloat);
  HP_EXPECT_THROW_MSG(cast_after.forward(x), "MC2Linear(up)::forward: MC2 dtype");
}

// The same limits hold for an MC2Linear configured by hand (no style): checked at forward.
TEST_F(MC2Style, HandConfiguredLinearChecksTheContractAtForward) {
  auto row = linear(1024, 128);
  tp::MC2Linear::from_linear(*row).configure_mc2(tp::MC2Mode::kReduceScatter, mesh->get_group(0), 1);
  HP_EXPECT_THROW_MSG(row(at::ones({1, 4, 1024}, at::kBFloat16)),
                      "MC2Linear::forward: MC2 row backward contraction n (out_features): expected "
                      "in [256, 65535), got 128");
  auto col = linear(128, 512);
  tp::MC2Linear::from_linear(*col).configure_mc2(tp::MC2Mode::kAllGather, mesh->get_group(0), 1);
  HP_EXPECT_THROW_MSG(col(at::ones({1, 4, 128}, at::kBFloat16)),
                      "MC2Linear::forward: MC2 contraction dim k (in_features): expected in [256, "
                      "65535), got 128");
}

TEST_F(MC2Style, AModuleTakesOneStyleAndIsLeftUntouchedOnError) {
  auto lin = linear(512, 512);
  tp::parallelize_module(*lin, *mesh, tp::ColwiseParallel());
  auto shard = lin->weight.detach().clone();
  HP_EXPECT_THROW_MSG(tp::parallelize_module(*lin, *mesh, tp::MC2ColwiseParallel()),
                      "MC2ColwiseParallel: expected a module no style has parallelized yet");
  HP_EXPECT_THROW_MSG(tp::parallelize_module(*lin, *mesh, tp::RowwiseParallel()),
                      "parameter 'weight' is already laid out (by another style");
  EXPECT_TRUE(lin->weight.equal(shard));
  EXPECT_FALSE(tp::MC2Linear::of(*lin).has_value());
}

TEST_F(MC2Style, UnevenSequenceShardsAreRejectedOnEveryRank) {
  // 7 tokens over 2 ranks (4 + 3): the fused ring needs equal blocks.
  auto col = linear(512, 512);
  tp::parallelize_module(*col, *mesh, tp::MC2ColwiseParallel());
  auto local = at::ones({2, 4 - hp_test::rank(), 512}, at::kBFloat16);
  auto x = DTensor::from_local(local, *mesh, {Shard(1)}, FromLocalOptions().run_check(true));
  HP_EXPECT_THROW_MSG(col(x.to_local_tagged()),
                      "MC2ColwiseParallel: expected the sequence length (dim 1 of the global "
                      "activation [2, 7, 512]) divisible by world_size 2, got 7");
}

TEST_F(MC2Style, SecondBackwardWithoutRetainedGraphIsAClearError) {
  auto col = linear(512, 512);
  tp::parallelize_module(*col, *mesh, tp::MC2ColwiseParallel());
  auto y = col(at::ones({1, 2, 512}, at::kBFloat16).requires_grad_(true)).sum();
  y.backward({}, /*retain_graph=*/true);
  y.backward();
  HP_EXPECT_THROW_MSG(y.backward(),
                      "Backward: expected a graph not yet freed, got one released by an earlier backward");
}

TEST_F(MC2Style, Llama3EnableMC2NeedsSequenceParallel) {
  llama3::Transformer model(llama3::ModelArgs::debug());
  HP_EXPECT_THROW_MSG(
      llama3::parallelize_llama3(
          *model, *mesh, llama3::ParallelizeOptions().enable_sequence_parallel(false).enable_mc2(true)),
      "parallelize_llama3: enable_mc2 requires enable_sequence_parallel");
}

}  // namespace
