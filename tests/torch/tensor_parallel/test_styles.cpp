// Parallel styles and parallelize_module against single-process references, with exact
// collective counts (the checklist in docs/tp-semantics.md).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <hyper_parallel/hyper_parallel.h>

#include "common/test_util.h"

namespace hp = hyper_parallel;
namespace tp = hp::tensor_parallel;
using namespace hp::dtensor;
using hp::comm::CollectiveKind;
using hp_test::expect_close;

namespace {

DeviceMesh tp_mesh() { return init_device_mesh("cpu", {hp_test::world_size()}, {"tp"}); }

struct Counts {
  int64_t forward_total, backward_total;
};

// Runs fwd (returns the output) and bwd (sum of output * seeded upstream) in counted regions.
template <typename Fwd>
at::Tensor run_counted(Fwd&& fwd) {
  hp::comm::reset_collective_counts();
  at::Tensor out;
  {
    hp::comm::CommRegion r("forward");
    out = fwd();
  }
  {
    hp::comm::CommRegion r("backward");
    out.sum().backward();
  }
  return out;
}

int64_t fwd(CollectiveKind k) { return hp::comm::collective_count(k, "forward"); }
int64_t bwd(CollectiveKind k) { return hp::comm::collective_count(k, "backward"); }
int64_t fwd_total() { return hp::comm::total_collective_count("forward"); }
int64_t bwd_total() { return hp::comm::total_collective_count("backward"); }

// Same full weights on every rank and in the reference.
hp::nn::Linear seeded_linear(int64_t in, int64_t out, uint64_t seed = 3) {
  at::manual_seed(seed);
  return hp::nn::Linear(in, out);
}

TEST(ColwiseParallel, LinearReplicateInput) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  auto ref = seeded_linear(16, 16);
  auto m = seeded_linear(16, 16);
  tp::parallelize_module(*m, tp_mesh(), tp::ColwiseParallel());
  at::manual_seed(11);
  auto x = at::randn({8, 16}).requires_grad_(true);
  auto xr = x.detach().clone().requires_grad_(true);
  auto out = run_counted([&] { return m(x); });
  EXPECT_EQ(out.sizes(), (at::IntArrayRef{8, 16 / p}));
  EXPECT_EQ(fwd_total(), 0);
  EXPECT_EQ(bwd_total(), 1);
  EXPECT_EQ(bwd(CollectiveKind::kAllReduce), 1);  // the input gradient is Partial
  auto expected = ref(xr);
  expected.sum().backward();
  expect_close(out, expected.narrow(1, r * 16 / p, 16 / p), "output");
  expect_close(x.grad(), xr.grad(), "input grad");
  expect_close(m->weight.grad(), ref->weight.grad().narrow(0, r * 16 / p, 16 / p), "weight grad");
  expect_close(m->bias.grad(), ref->bias.grad().narrow(0, r * 16 / p, 16 / p), "bias grad");
}

TEST(ColwiseParallel, LinearShardedInputIsGathered) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  auto ref = seeded_linear(16, 16);
  auto m = seeded_linear(16, 16);
  tp::parallelize_module(*m, tp_mesh(),
                         tp::ColwiseParallel(tp::ColwiseParallelOptions().input_layouts(Shard(0))));
  at::manual_seed(11);
  auto full_x = at::randn({8 * p, 16});
  auto x = full_x.narrow(0, r * 8, 8).clone().requires_grad_(true);
  auto xr = full_x.clone().requires_grad_(true);
  auto out = run_counted([&] { return m(x); });
  EXPECT_EQ(out.sizes(), (at::IntArrayRef{8 * p, 16 / p}));
  EXPECT_EQ(fwd_total(), p > 1 ? 1 : 1);
  EXPECT_EQ(fwd(CollectiveKind::kAllGather), 1);
  EXPECT_EQ(bwd_total(), 1);
  EXPECT_EQ(bwd(CollectiveKind::kReduceScatter), 1);
  ref(xr).sum().backward();
  expect_close(x.grad(), xr.grad().narrow(0, r * 8, 8), "input grad");
}

TEST(ColwiseParallel, EmbeddingShardsFeatures) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  at::manual_seed(4);
  hp::nn::Embedding ref(16, 16);
  at::manual_seed(4);
  hp::nn::Embedding m(16, 16);
  tp::parallelize_module(*m, tp_mesh(), tp::ColwiseParallel());
  auto ids = at::arange(8, at::kLong).reshape({4, 2}) * 2;
  auto out = run_counted([&] { return m(ids); });
  EXPECT_EQ(out.sizes(), (at::IntArrayRef{4, 2, 16 / p}));
  EXPECT_EQ(hp::comm::total_collective_count(), 0);
  expect_close(out, ref(ids).narrow(2, r * 16 / p, 16 / p));
}

TEST(RowwiseParallel, LinearReplicateAndShardedOutputs) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  for (bool shard_output : {false, true}) {
    SCOPED_TRACE(shard_output ? "output Shard(0)" : "output Replicate");
    auto ref = seeded_linear(16, 16);
    auto m = seeded_linear(16, 16);
    auto options = tp::RowwiseParallelOptions();
    if (shard_output) options.output_layouts(Shard(0));
    tp::parallelize_module(*m, tp_mesh(), tp::RowwiseParallel(options));
    at::manual_seed(12);
    auto full_x = at::randn({8, 16});
    auto x = full_x.narrow(1, r * 16 / p, 16 / p).clone().requires_grad_(true);
    auto xr = full_x.clone().requires_grad_(true);
    auto out = run_counted([&] { return m(x); });
    auto expected = ref(xr);
    expected.sum().backward();
    if (shard_output) {
      EXPECT_EQ(out.sizes(), (at::IntArrayRef{8 / p, 16}));
      EXPECT_EQ(fwd(CollectiveKind::kReduceScatter), 1);
      EXPECT_EQ(bwd(CollectiveKind::kAllGather), 1);
      expect_close(out, expected.narrow(0, r * 8 / p, 8 / p), "output");
      EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllReduce, "grad_sync"), p > 1 ? 1 : 0)
          << "the bias gradient is Partial and summed once";
    } else {
      EXPECT_EQ(out.sizes(), (at::IntArrayRef{8, 16}));
      EXPECT_EQ(fwd(CollectiveKind::kAllReduce), 1);
      expect_close(out, expected, "output");
    }
    EXPECT_EQ(fwd_total(), 1);
    EXPECT_EQ(bwd_total(), shard_output ? 1 : 0);
    expect_close(x.grad(), xr.grad().narrow(1, r * 16 / p, 16 / p), "input grad");
    expect_close(m->bias.grad(), ref->bias.grad(), "bias grad (added once)");
    expect_close(m->weight.grad(), ref->weight.grad().narrow(1, r * 16 / p, 16 / p), "weight grad");
  }
}

TEST(RowwiseParallel, EmbeddingShardsVocabulary) {
  const int64_t p = hp_test::world_size();
  for (bool shard_output : {false, true}) {
    SCOPED_TRACE(shard_output ? "output Shard(1)" : "output Replicate");
    at::manual_seed(4);
    hp::nn::Embedding ref(16, 16);
    at::manual_seed(4);
    hp::nn::Embedding m(16, 16);
    auto options = tp::RowwiseParallelOptions().input_layouts(Replicate());
    if (shard_output) options.output_layouts(Shard(1));
    tp::parallelize_module(*m, tp_mesh(), tp::RowwiseParallel(options));
    auto ids = (at::arange(8, at::kLong).reshape({4, 2}) * 3).remainder(16);
    auto out = run_counted([&] { return m(ids); });
    auto expected = ref(ids);
    if (shard_output) {
      const int64_t r = hp_test::rank();
      EXPECT_EQ(out.sizes(), (at::IntArrayRef{4, shard_size(2, p, r), 16}));
      EXPECT_EQ(fwd(CollectiveKind::kReduceScatter), 1);
      EXPECT_EQ(bwd(CollectiveKind::kAllGather), 1);
      expect_close(out, expected.narrow(1, shard_offset(2, p, r), shard_size(2, p, r)));
    } else {
      EXPECT_EQ(out.sizes(), (at::IntArrayRef{4, 2, 16}));
      EXPECT_EQ(fwd(CollectiveKind::kAllReduce), 1);
      EXPECT_EQ(bwd_total(), 0);
      expect_close(out, expected);
    }
  }
}

TEST(SequenceParallel, NormRunsOnLocalTokensWithoutCommunication) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  at::manual_seed(9);
  hp::nn::RMSNorm ref(12);
  hp::nn::RMSNorm m(12);
  {
    at::NoGradGuard g;
    auto w = at::randn({12});
    ref->weight.copy_(w);
    m->weight.copy_(w);
  }
  tp::parallelize_module(*m, tp_mesh(), tp::SequenceParallel());
  auto full_x = at::randn({20, 8 * p, 12});
  auto upstream = at::randn({20, 8 * p, 12});
  auto x = full_x.narrow(1, r * 8, 8).clone().requires_grad_(true);
  auto xr = full_x.clone().requires_grad_(true);
  hp::comm::reset_collective_counts();
  at::Tensor out;
  {
    hp::comm::CommRegion f("forward");
    out = m(x);
  }
  {
    hp::comm::CommRegion b("backward");
    (out * upstream.narrow(1, r * 8, 8)).sum().backward();
  }
  EXPECT_EQ(fwd_total(), 0);
  EXPECT_EQ(bwd_total(), 0);
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllReduce, "grad_sync"), p > 1 ? 1 : 0);
  auto expected = ref(xr);
  (expected * upstream).sum().backward();
  EXPECT_EQ(out.sizes(), (at::IntArrayRef{20, 8, 12}));
  expect_close(out, expected.narrow(1, r * 8, 8), "output");
  expect_close(x.grad(), xr.grad().narrow(1, r * 8, 8), "input grad");
  expect_close(m->weight.grad(), ref->weight.grad(), "weight grad summed over ranks");
  // use_local_output=false: the output carries its layout to the next style.
  auto tagged = DTensor::from_tagged(out);
  ASSERT_TRUE(tagged.has_value());
  EXPECT_EQ(tagged->placements(), Placements{Shard(1)});
  EXPECT_EQ(tagged->shape(), (std::vector<int64_t>{20, 8 * p, 12}));
}

// A node that fails in backward, placed before the norm in forward (so after it in backward).
struct FailInBackward : public torch::autograd::Function<FailInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    TORCH_CHECK(false, "FailInBackward: on purpose");
  }
};

// The sum over ranks of `part` (each rank's own), from gathered parts.
at::Tensor sum_of_parts(const at::Tensor& part) {
  return hp::comm::all_gather(part.unsqueeze(0), 0, hp::comm::world()).sum(0);
}

// This rank's part of a sequence-parallel norm's weight gradient: an unparallelized copy's
// weight gradient on this rank's tokens.
at::Tensor weight_part(const at::Tensor& weight, const at::Tensor& x) {
  hp::nn::RMSNorm plain(weight.size(0));
  {
    at::NoGradGuard no_grad;
    plain->weight.copy_(weight);
  }
  auto in = x.detach();
  (plain(in) * in).sum().backward();
  return plain->weight.grad();
}

// The gradient sum of a sequence-parallel parameter is started in backward and finished when the
// backward ends: the backward does not wait for it (no blocking all_reduce in "grad_sync"; the
// one wait is the started sum's, at the end), and .grad holds the sum after backward(), over
// accumulation and after a backward that failed.
TEST(SequenceParallel, GradientSumRunsWhileTheBackwardGoesOn) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  at::manual_seed(19);
  hp::nn::RMSNorm m(12);
  tp::parallelize_module(*m, tp_mesh(), tp::SequenceParallel());
  auto full_x = at::randn({4, 8 * p, 12});
  auto x = full_x.narrow(1, r * 8, 8).clone().requires_grad_(true);
  auto backward = [&](bool fail) {
    auto in = fail ? FailInBackward::apply(x) : x;
    hp::comm::CommRegion b("backward");
    (m(in) * in).sum().backward();
  };
  hp::comm::reset_collective_counts();
  backward(false);
  EXPECT_TRUE(at::equal(m->weight.grad(), sum_of_parts(weight_part(m->weight, x))));
  for (const auto& w : hp::comm::exposed_waits()) {
    EXPECT_FALSE(w.region == "grad_sync" && w.op == "all_reduce")
        << "the backward blocked for " << w.seconds << " s";
  }
  // Accumulation: the second pass's sum is added to the first's.
  const auto first = m->weight.grad().clone();
  backward(false);
  expect_close(m->weight.grad(), (first * 2).to(at::kDouble), "accumulated sums");
  // A backward that fails after the sum started: the sum is waited for and dropped; the next is right.
  m->weight.mutable_grad() = at::Tensor();
  EXPECT_THROW(backward(true), c10::Error);
  if (p > 1) {
    EXPECT_FALSE(m->weight.grad().defined());  // on one rank AccumulateGrad added it, as torch's
  }
  m->weight.mutable_grad() = at::Tensor();
  backward(false);
  EXPECT_TRUE(at::equal(m->weight.grad(), first));
}

// Only the gradient of the module's own forward is summed: a loss term on the parameter itself,
// which every rank computes alike, reaches .grad once (PyTorch: a Replicate gradient beside the
// Partial one), whether the sum travels during the backward or a hook or a capture makes the
// backward wait for it; hooks and captures see the whole gradient.
TEST(SequenceParallel, LossTermOnTheParameterIsNotSummed) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  at::manual_seed(23);
  hp::nn::RMSNorm m(12);
  {
    at::NoGradGuard no_grad;
    m->weight.uniform_(0.5, 1.5);
  }
  tp::parallelize_module(*m, tp_mesh(), tp::SequenceParallel());
  auto full_x = at::randn({4, 8 * p, 12});
  auto x = full_x.narrow(1, r * 8, 8).clone().requires_grad_(true);
  const auto expected = sum_of_parts(weight_part(m->weight, x)) + 0.2 * m->weight.detach();
  auto loss = [&] { return (m(x) * x).sum() + 0.1 * m->weight.pow(2).sum(); };
  for (int penalty_first = 0; penalty_first < 2; ++penalty_first) {
    m->weight.mutable_grad() = at::Tensor();
    auto l = penalty_first ? 0.1 * m->weight.pow(2).sum() + (m(x) * x).sum() : loss();
    l.backward();
    expect_close(m->weight.grad(), expected.to(at::kDouble),
                 "penalty order " + std::to_string(penalty_first));
  }
  // A hook sees the whole gradient, once.
  m->weight.mutable_grad() = at::Tensor();
  std::vector<at::Tensor> seen;
  const auto hook = m->weight.register_hook([&](const at::Tensor& g) { seen.push_back(g.clone()); });
  loss().backward();
  m->weight.remove_hook(hook);
  ASSERT_EQ(seen.size(), 1u);
  expect_close(seen[0], expected.to(at::kDouble), "hook");
  expect_close(m->weight.grad(), expected.to(at::kDouble), "grad with a hook");
  // A capture (autograd.grad) too, and .grad is left alone.
  m->weight.mutable_grad() = at::Tensor();
  const auto captured = torch::autograd::grad({loss()}, {m->weight})[0];
  expect_close(captured, expected.to(at::kDouble), "captured");
  EXPECT_FALSE(m->weight.grad().defined());
}

// A HookableModule of the user's whose forward reads its weight itself, not through parameter():
// its gradient would be this rank's part only, so its first forward with grad is an error.
class DirectReaderImpl : public torch::nn::Module, public hp::nn::HookableModule {
 public:
  DirectReaderImpl() { weight = register_parameter("weight", at::ones({12})); }
  at::Tensor forward(const at::Tensor& x) { return run_output_hooks(run_input_hooks(x) * weight); }
  at::Tensor weight;
};
TORCH_MODULE(DirectReader);

TEST(SequenceParallel, AForwardThatDoesNotReadThroughTheHookIsAnError) {
  DirectReader m;
  tp::parallelize_module(*m, tp_mesh(), tp::SequenceParallel());
  auto x = at::randn({2, 4, 12});
  {
    at::NoGradGuard no_grad;
    EXPECT_NO_THROW(m(x));  // nothing to sum without grad
  }
  EXPECT_THROW(m(x), c10::ValueError);
  HP_EXPECT_THROW_MSG(m(x), "forward to read its parameter 'weight' through HookableModule::parameter()");
}

// A module whose parameters live in a submodule: the style's hooks see the module's own reads
// only, so the submodule's gradients would stay this rank's part. A clear error, before anything
// is laid out.
class NormWrapperImpl : public torch::nn::Module, public hp::nn::HookableModule {
 public:
  NormWrapperImpl() { norm = register_module("norm", hp::nn::RMSNorm(12)); }
  at::Tensor forward(const at::Tensor& x) { return run_output_hooks(norm(run_input_hooks(x))); }
  hp::nn::RMSNorm norm{nullptr};
};
TORCH_MODULE(NormWrapper);

TEST(SequenceParallel, AModuleWhoseSubmoduleHoldsParametersIsAnError) {
  NormWrapper m;
  const auto before = m->norm->weight.clone();
  EXPECT_THROW(tp::parallelize_module(*m, tp_mesh(), tp::SequenceParallel()), c10::NotImplementedError);
  HP_EXPECT_THROW_MSG(
      tp::parallelize_module(*m, tp_mesh(), tp::SequenceParallel()),
      "NormWrapperImpl whose submodule holds 'norm.weight' (apply the style to that submodule)");
  HP_EXPECT_THROW_MSG(tp::parallelize_module(*m, tp_mesh(), tp::SequenceParallel()),
                      "SequenceParallel: expected a module whose parameters are all its own, got ");
  EXPECT_FALSE(hp::nn::recorded_layout(m->norm->weight).has_value());
  EXPECT_TRUE(at::equal(m->norm->weight, before));
  tp::parallelize_module(*m, tp_mesh(), {{"norm", std::make_shared<tp::SequenceParallel>()}});
}

// Linear(10,16) -> ReLU -> Linear(16,10), as in PyTorch's tensor-parallel tests.
class MLPImpl : public torch::nn::Module {
 public:
  MLPImpl() {
    net1 = register_module("net1", hp::nn::Linear(10, 16));
    relu = register_module("relu", torch::nn::ReLU());
    net2 = register_module("net2", hp::nn::Linear(16, 10));
  }
  at::Tensor forward(const at::Tensor& x) { return net2(relu(net1(x))); }
  hp::nn::Linear net1{nullptr}, net2{nullptr};
  torch::nn::ReLU relu{nullptr};
};
TORCH_MODULE(MLP);

TEST(ParallelizeModule, MLPMatchesSingleProcessThroughAnOptimizerStep) {
  const int64_t p = hp_test::world_size();
  at::manual_seed(5);
  MLP ref;
  at::manual_seed(5);
  MLP model;
  tp::parallelize_module(
      *model, tp_mesh(),
      {{"net1", std::make_shared<tp::ColwiseParallel>()}, {"net2", std::make_shared<tp::RowwiseParallel>()}});
  auto full = tp::full_named_parameters(*model);
  auto ref_params = ref->named_parameters();
  ASSERT_EQ(full.size(), ref_params.size());
  for (const auto& [name, t] : full) expect_close(t, ref_params[name], name + " before");
  torch::optim::SGD opt(model->parameters(), 0.25), ref_opt(ref->parameters(), 0.25);
  at::manual_seed(6);
  auto x = at::rand({20, 10});
  hp::comm::reset_collective_counts();
  auto out = model(x);
  auto expected = ref(x);
  expect_close(out, expected, "output");
  out.sum().backward();
  expected.sum().backward();
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllReduce), 1);  // net2's forward
  EXPECT_EQ(hp::comm::total_collective_count(), 1);
  for (const auto& [name, g] : tp::full_named_parameters(*model, /*gradients=*/true)) {
    expect_close(g, ref_params[name].grad(), name + " grad");
  }
  opt.step();
  ref_opt.step();
  for (const auto& [name, t] : tp::full_named_parameters(*model)) {
    expect_close(t, ref_params[name], name + " after step");
  }
  (void)p;
}

TEST(ParallelizeModule, SequenceParallelMLPCollectiveCounts) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  at::manual_seed(5);
  MLP ref;
  at::manual_seed(5);
  MLP model;
  tp::parallelize_module(
      *model, tp_mesh(),
      {{"net1", std::make_shared<tp::ColwiseParallel>(tp::ColwiseParallelOptions().input_layouts(Shard(0)))},
       {"net2",
        std::make_shared<tp::RowwiseParallel>(tp::RowwiseParallelOptions().output_layouts(Shard(0)))}});
  at::manual_seed(6);
  auto full_x = at::rand({4 * p, 10});
  auto out = run_counted([&] { return model(full_x.narrow(0, r * 4, 4)); });
  // Forward: all-gather (net1 input), reduce-scatter (net2 output); backward: all-gather
  // (net2's output gradient); the input needs no gradient, so no reduce-scatter for it.
  EXPECT_EQ(fwd(CollectiveKind::kAllGather), 1);
  EXPECT_EQ(fwd(CollectiveKind::kReduceScatter), 1);
  EXPECT_EQ(bwd(CollectiveKind::kAllGather), 1);
  EXPECT_EQ(fwd_total(), 2) << hp::comm::collective_counts_summary();
  EXPECT_EQ(bwd_total(), 1) << hp::comm::collective_counts_summary();
  auto expected = ref(full_x);
  expect_close(out, expected.narrow(0, r * 4, 4));
  expected.sum().backward();
  auto ref_params = ref->named_parameters();
  for (const auto& [name, g] : tp::full_named_parameters(*model, /*gradients=*/true)) {
    expect_close(g, ref_params[name].grad(), name + " grad");
  }
}

class TreeImpl : public torch::nn::Module {
 public:
  TreeImpl() {
    net1 = register_module("net1", hp::nn::Linear(8, 8));
    net2 = register_module("net2", hp::nn::Linear(8, 8));
    layers = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) {
      auto block = std::make_shared<torch::nn::Module>();
      block->register_module("net0", hp::nn::Linear(8, 8));
      block->register_module("net1", hp::nn::Linear(8, 8));
      layers->push_back(block);
    }
  }
  hp::nn::Linear net1{nullptr}, net2{nullptr};
  torch::nn::ModuleList layers{nullptr};
};
TORCH_MODULE(Tree);

std::vector<std::string> parallelized(torch::nn::Module& root) {
  std::vector<std::string> names;
  for (const auto& item : root.named_modules()) {
    auto* hm = dynamic_cast<hp::nn::HookableModule*>(item.value().get());
    if (hm && hm->num_output_hooks() > 0) names.push_back(item.key());
  }
  return names;
}

TEST(ParallelizeModule, GlobKeysMatchPerToken) {
  auto mesh = tp_mesh();
  auto style = std::make_shared<tp::ColwiseParallel>();
  struct Case {
    std::string key;
    std::vector<std::string> expected;
  };
  const Case cases[] = {
      {"net*", {"net1", "net2"}},
      {"net?", {"net1", "net2"}},
      {"net[1-2]", {"net1", "net2"}},
      {"net[2]", {"net2"}},
      {"layers.*.net[1]", {"layers.0.net1", "layers.1.net1", "layers.2.net1"}},
      {"layers.1.net0", {"layers.1.net0"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.key);
    Tree tree;
    tp::parallelize_module(*tree, mesh, {{c.key, style}});
    EXPECT_EQ(parallelized(*tree), c.expected);
  }
  // "" is the root itself.
  auto lin = seeded_linear(8, 8);
  tp::parallelize_module(*lin, mesh, {{"", style}});
  EXPECT_EQ(lin->num_output_hooks(), 1u);
}

TEST(ParallelizeModule, UnmatchedKeysAndEmptyPlansWarn) {
  auto mesh = tp_mesh();
  Tree tree;
  {
    hp_test::CapturedWarnings warnings;
    tp::parallelize_module(*tree, mesh, {{"nope.*", std::make_shared<tp::ColwiseParallel>()}});
    EXPECT_TRUE(warnings.contains("plan key 'nope.*' (ColwiseParallel) matched no submodule"));
  }
  {
    hp_test::CapturedWarnings warnings;
    tp::parallelize_module(*tree, mesh, tp::ParallelizePlan{});
    EXPECT_TRUE(warnings.contains("the plan is empty"));
  }
}

// A module with two inputs, to exercise per-input layouts and "leave alone" entries.
class TwoInputsImpl : public torch::nn::Module, public hp::nn::HookableModule {
 public:
  std::vector<at::Tensor> forward(const at::Tensor& a, const at::Tensor& b) {
    return run_output_hooks(run_input_hooks(std::vector<at::Tensor>{a, b}));
  }
};
TORCH_MODULE(TwoInputs);

TEST(PrepareModuleInputOutput, PerInputLayoutsAndLeaveAlone) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  auto mesh = tp_mesh();
  TwoInputs m;
  tp::parallelize_module(*m, mesh,
                         tp::PrepareModuleInput(tp::PrepareModuleInputOptions()
                                                    .input_layouts({Shard(0), std::nullopt})
                                                    .desired_input_layouts({Replicate(), std::nullopt})
                                                    .use_local_output(true)));
  tp::parallelize_module(*m, mesh,
                         tp::PrepareModuleOutput(tp::PrepareModuleOutputOptions()
                                                     .output_layouts({Replicate(), std::nullopt})
                                                     .desired_output_layouts({Shard(1), std::nullopt})));
  // Element (i, j) of rank r's a is 100 r + 10 i + j: every value says where it came from.
  auto a_of = [&](int64_t rank) {
    return at::arange(2, at::kFloat).unsqueeze(1) * 10 + at::arange(2 * p, at::kFloat) + 100.0 * rank;
  };
  auto a = a_of(r);
  auto b = at::full({3}, double(r));
  auto outs = m(a, b);
  // a: gathered over dim 0 (Shard(0) -> Replicate), then this rank's columns (-> Shard(1)).
  std::vector<at::Tensor> blocks;
  for (int64_t k = 0; k < p; ++k) blocks.push_back(a_of(k));
  EXPECT_TRUE(outs[0].equal(at::cat(blocks, 0).narrow(1, 2 * r, 2))) << outs[0];
  EXPECT_TRUE(outs[1].equal(b));  // left alone
  auto again = m(a, b);           // hooks are reusable
  EXPECT_TRUE(again[0].equal(outs[0]));
}

TEST(StyleErrors, ClearMessages) {
  auto mesh = tp_mesh();
  hp::nn::RMSNorm norm(8);
  HP_EXPECT_THROW_MSG(tp::parallelize_module(*norm, mesh, tp::ColwiseParallel()),
                      "ColwiseParallel: expected hyper_parallel::nn::Linear or nn::Embedding, got");
  HP_EXPECT_THROW_MSG(tp::parallelize_module(*norm, mesh, tp::RowwiseParallel()),
                      "RowwiseParallel: expected hyper_parallel::nn::Linear or nn::Embedding");
  torch::nn::Linear torch_linear(4, 4);
  HP_EXPECT_THROW_MSG(tp::parallelize_module(*torch_linear, mesh, tp::ColwiseParallel()),
                      "expected a module of this library");
  HP_EXPECT_THROW_MSG(tp::PrepareModuleInput(tp::PrepareModuleInputOptions()
                                                 .input_layouts({Shard(0), Shard(1)})
                                                 .desired_input_layouts({Replicate()})),
                      "expected input_layouts and desired_input_layouts of the same length, got 2 and 1");
  HP_EXPECT_THROW_MSG(
      tp::PrepareModuleOutput(
          tp::PrepareModuleOutputOptions().output_layouts({Shard(0)}).desired_output_layouts({std::nullopt})),
      "both set or both left alone");
  TwoInputs m;
  tp::parallelize_module(
      *m, mesh,
      tp::PrepareModuleInput(
          tp::PrepareModuleInputOptions().input_layouts({Shard(0)}).desired_input_layouts({Replicate()})));
  HP_EXPECT_THROW_MSG(m(at::ones({2}), at::ones({2})), "PrepareModuleInput: expected 1 inputs");
  auto lin = seeded_linear(8, 8);
  HP_EXPECT_THROW_MSG(
      tp::parallelize_module(*lin, mesh,
                             tp::RowwiseParallel(tp::RowwiseParallelOptions().output_layouts(Partial()))),
      "RowwiseParallel: expected output_layouts Shard or Replicate, got Partial(sum)");
  if (hp_test::world_size() % 2 == 0) {
    auto mesh2 = init_device_mesh("cpu", {2, hp_test::world_size() / 2}, {"dp", "tp"});
    HP_EXPECT_THROW_MSG(tp::parallelize_module(*lin, mesh2, tp::ColwiseParallel()),
                        "parallelize_module: expected a 1-d TP mesh, got a 2-d mesh");
  }
}

// The rules each style holds, which the Python front end applies to torch.nn modules too.
TEST(StyleRules, ParameterTables) {
  using hp::nn::ModuleKind;
  auto rows = [](const tp::ParallelStyle& style, ModuleKind kind, std::vector<std::string> params) {
    std::string text;
    for (const auto& r : style.parameter_shardings(kind, params)) {
      text += r.name + "=" + to_string(r.placements) + (r.sums_gradient ? "+sum " : " ");
    }
    return text;
  };
  EXPECT_EQ(rows(tp::ColwiseParallel(), ModuleKind::kLinear, {"weight", "bias"}),
            "weight=[Shard(0)] bias=[Shard(0)] ");
  EXPECT_EQ(rows(tp::ColwiseParallel(), ModuleKind::kLinear, {"weight"}), "weight=[Shard(0)] ");
  EXPECT_EQ(rows(tp::ColwiseParallel(), ModuleKind::kEmbedding, {"weight"}), "weight=[Shard(1)] ");
  EXPECT_EQ(rows(tp::RowwiseParallel(), ModuleKind::kLinear, {"weight", "bias"}),
            "weight=[Shard(1)] bias=[Replicate()] ");
  EXPECT_EQ(rows(tp::RowwiseParallel(tp::RowwiseParallelOptions().output_layouts(Shard(1))),
                 ModuleKind::kLinear, {"weight", "bias"}),
            "weight=[Shard(1)] bias=[Replicate()]+sum ");
  EXPECT_EQ(rows(tp::RowwiseParallel(), ModuleKind::kEmbedding, {"weight"}), "weight=[Shard(0)] ");
  EXPECT_EQ(rows(tp::SequenceParallel(), ModuleKind::kOther, {"weight", "bias"}),
            "weight=[Replicate()]+sum bias=[Replicate()]+sum ");
  EXPECT_EQ(rows(tp::MC2ColwiseParallel(), ModuleKind::kLinear, {"weight", "bias"}),
            "weight=[Shard(0)] bias=[Shard(0)] ");
  EXPECT_EQ(rows(tp::MC2RowwiseParallel(), ModuleKind::kLinear, {"weight", "bias"}),
            "weight=[Shard(1)] bias=[Replicate()] ");
  EXPECT_EQ(tp::MC2RowwiseParallel(tp::MC2RowwiseParallelOptions().output_layouts(Shard(-2))).sequence_dim(),
            -1);
  EXPECT_EQ(tp::MC2ColwiseParallel().sequence_dim(), 1);
}

TEST(StyleRules, TheKindIsCheckedBeforeTheMesh) {
  hp::nn::RMSNorm norm(8);
  const auto flat = init_device_mesh("cpu", {hp_test::world_size(), 1}, {"tp", "x"});
  HP_EXPECT_THROW_MSG(tp::ColwiseParallel().apply(*norm, flat),
                      "ColwiseParallel: expected hyper_parallel::nn::Linear or nn::Embedding");
  hp::nn::Embedding embedding(8, 4);
  try {
    tp::MC2ColwiseParallel().apply(*embedding, flat);
    ADD_FAILURE() << "expected NotImplementedError";
  } catch (const c10::NotImplementedError& e) {
    EXPECT_NE(std::string(e.what()).find("MC2ColwiseParallel does not support Embedding"), std::string::npos);
  }
  HP_EXPECT_THROW_MSG(tp::check_unclaimed("RowwiseParallel", "Linear", std::string("ColwiseParallel")),
                      "RowwiseParallel: expected a module no style has parallelized yet, got Linear already "
                      "parallelized by ColwiseParallel");
}

// The vocabulary-parallel loss and its logits' gradient on each rank's chunk against torch's
// cross_entropy on the full logits: a vocabulary that does not divide over the ranks (at 4 ranks,
// chunks of 2, 2, 2 and 1), targets on every chunk, a scaled upstream gradient, float32 and bf16.
TEST(VocabParallelCrossEntropy, LossAndLogitsGradientMatchCrossEntropy) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank(), vocab = 7;
  const auto mesh = tp_mesh();
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    at::manual_seed(11);
    const auto full = at::randn({2, 5, vocab}).to(dtype);
    const auto targets = at::arange(10).remainder(vocab).view({2, 5});  // every id, so every chunk
    auto ref_logits = full.to(at::kDouble).requires_grad_();
    const auto ref_loss = at::cross_entropy_loss(ref_logits.flatten(0, 1), targets.flatten());
    (ref_loss * 0.7).backward();
    const int64_t start = shard_offset(vocab, p, r), size = shard_size(vocab, p, r);
    auto local = full.narrow(-1, start, size).clone().requires_grad_();
    const auto loss = tp::vocab_parallel_cross_entropy(local, targets, vocab, mesh);
    (loss * 0.7).backward();
    const std::string what = std::string("rank ") + std::to_string(r) + ", " + c10::toString(dtype);
    expect_close(loss, ref_loss.to(loss.scalar_type()), what + ": loss");
    ASSERT_EQ(local.grad().scalar_type(), dtype) << what;
    expect_close(local.grad(), ref_logits.grad().narrow(-1, start, size), what + ": d logits");
  }
}

// A double backward (create_graph) is refused, not computed wrong: the logits' gradient is
// computed outside autograd, so a derivative of it (a gradient penalty) would miss the softmax's.
TEST(VocabParallelCrossEntropy, ADoubleBackwardIsAnError) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank(), vocab = 7;
  at::manual_seed(12);
  const auto full = at::randn({3, vocab});
  const auto targets = at::arange(3).mul(3).remainder(vocab);
  const int64_t start = shard_offset(vocab, p, r), size = shard_size(vocab, p, r);
  auto local = full.narrow(-1, start, size).clone().requires_grad_();
  for (const bool log_softmax : {false, true}) {
    const auto loss = log_softmax ? tp::vocab_parallel_nll_loss(
                                        tp::vocab_parallel_log_softmax(local, vocab, tp_mesh()).to_local(),
                                        targets, vocab, tp_mesh())
                                  : tp::vocab_parallel_cross_entropy(local, targets, vocab, tp_mesh());
    try {
      torch::autograd::grad({loss}, {local}, {}, /*retain_graph=*/true, /*create_graph=*/true);
      ADD_FAILURE() << "expected NotImplementedError";
    } catch (const c10::NotImplementedError& e) {
      EXPECT_NE(std::string(e.what()).find("Backward: expected a backward without create_graph, got "
                                           "create_graph=True"),
                std::string::npos)
          << e.what();
    }
    torch::autograd::grad({loss}, {local});  // without create_graph: as before
  }
}

// The unfused pair, nll_loss(log_softmax(x, -1)), against torch's on the full logits: each rank's
// chunk of the log-probabilities (a DTensor sharded as the logits), the loss with ignored targets
// and each reduction, the logits' gradient through both ops (the log_softmax backward's
// all-reduce), in the logits' layout for a transposed input; exact collective counts; a vocabulary
// with fewer entries than ranks at 4 (chunks of 1, 1, 1 and 0).
TEST(VocabParallelNllLoss, OfLogSoftmaxMatchesTorchsLossAndGradient) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  const auto mesh = tp_mesh();
  for (const int64_t vocab : {7, 3}) {
    for (const auto reduction :
         {tp::LossReduction::kMean, tp::LossReduction::kSum, tp::LossReduction::kNone}) {
      at::manual_seed(13);
      const auto full = at::randn({vocab, 6}).t();  // [6, vocab], not contiguous
      auto targets = at::arange(6).remainder(vocab);
      targets[2] = -100;
      const int64_t torch_reduction = reduction == tp::LossReduction::kNone   ? 0
                                      : reduction == tp::LossReduction::kMean ? 1
                                                                              : 2;
      auto ref_logits = full.to(at::kDouble).requires_grad_();
      const auto ref_log_probs = at::log_softmax(ref_logits, -1);
      const auto ref_loss = at::nll_loss_nd(ref_log_probs, targets, {}, torch_reduction, -100);
      const int64_t start = shard_offset(vocab, p, r), size = shard_size(vocab, p, r);
      auto local = full.narrow(-1, start, size).requires_grad_();
      hp::comm::reset_collective_counts();
      const auto log_probs = tp::vocab_parallel_log_softmax(local, vocab, mesh);
      const auto loss = tp::vocab_parallel_nll_loss(log_probs.to_local(), targets, vocab, mesh, reduction);
      EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllGather), 1);  // the row maxima
      EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllReduce), 2);  // sum of exp, targets
      EXPECT_EQ(log_probs.shape(), (std::vector<int64_t>{6, vocab}));
      const auto upstream = at::linspace(0.5, 1.5, loss.numel()).view(loss.sizes());
      (ref_loss * upstream.to(at::kDouble)).sum().backward();
      (loss * upstream).sum().backward();
      EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllReduce), 3);  // + sum of d y
      const std::string what = "rank " + std::to_string(r) + ", vocab " + std::to_string(vocab);
      expect_close(log_probs.to_local(), ref_log_probs.narrow(-1, start, size).to(at::kFloat), what + ": y");
      expect_close(loss, ref_loss.to(at::kFloat), what + ": loss");
      expect_close(local.grad(), ref_logits.grad().narrow(-1, start, size).to(at::kFloat),
                   what + ": d logits");
      EXPECT_EQ(local.grad().strides(), local.strides()) << what;
    }
  }
}

}  // namespace
