// fully_shard's gradient reduce-scatters in buckets (FullyShardOptions::reduce_bucket_cap_bytes)
// at world sizes 1, 2, 3 and 4: bitwise the one-reduce-scatter-per-group training for caps that
// cut every group into one bucket per parameter, a few, or one; the first backward's buckets
// agreed per op and the later ones following its plan; a bucket leaves while its group's
// backward still runs; exact reduce-scatter counts; a parameter the forward does not use, one
// frozen and unfrozen between steps, gradient hooks, a backward that fails part-way, ranks whose
// first backward reaches different parameters, gradient accumulation without sync (with hooks on
// a parameter only the unsynced micro-batches reach, a sequence-parallel norm's TP sum among
// them) and HSDP.
#include <functional>
#include <map>
#include <string>

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <hyper_parallel/hyper_parallel.h>

#include "common/test_util.h"

namespace hp = hyper_parallel;
namespace fs = hp::fully_shard;
using hp::comm::CollectiveKind;

namespace {

// Sizes no world size of the test divides: uneven and empty pieces.
constexpr int64_t kIn = 12, kHidden = 20, kRowsPerRank = 3;

// A block whose `spare` the forward uses only when asked: its gradient is absent from some
// backwards, as a layer skipped in a step.
struct Block : torch::nn::Module {
  Block() {
    up = register_module("up", hp::nn::Linear(kIn, kHidden));
    down = register_module("down", hp::nn::Linear(kHidden, kIn));
    spare = register_module("spare", hp::nn::Linear(kIn, kIn));
  }
  // `spare_reached` false: spare runs, but the backward does not reach it.
  at::Tensor forward(const at::Tensor& x, bool use_spare, bool spare_reached = true) {
    auto y = x + down(at::relu(up(x)));
    if (!use_spare) return y;
    auto out = spare(y);
    return spare_reached ? out : y + 0 * out.detach();
  }
  hp::nn::Linear up{nullptr}, down{nullptr}, spare{nullptr};
};

struct Net : torch::nn::Module {
  Net() {
    at::manual_seed(11);
    first = register_module("first", std::make_shared<Block>());
    second = register_module("second", std::make_shared<Block>());
    head = register_module("head", hp::nn::Linear(kIn, 2));
  }
  at::Tensor forward(const at::Tensor& x, bool use_spare = true, bool spare_reached = true) {
    return head(second->forward(first->forward(x, use_spare, spare_reached), use_spare, spare_reached));
  }
  std::shared_ptr<Block> first, second;
  hp::nn::Linear head{nullptr};
};

constexpr int64_t kGroups = 3, kParamsPerBlock = 6, kParams = 2 * kParamsPerBlock + 2;

// This rank's rows of step `step`'s global batch.
at::Tensor batch(int64_t step) {
  at::manual_seed(200 + step);
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  return at::randn({p * kRowsPerRank, kIn}).narrow(0, r * kRowsPerRank, kRowsPerRank);
}

void shard(Net& net, const fs::FullyShardOptions& options) {
  fs::fully_shard(*net.first, options);
  fs::fully_shard(*net.second, options);
  fs::fully_shard(net, options);
}

fs::FullyShardOptions with_cap(int64_t cap) {
  return fs::FullyShardOptions()
      .mesh(hp::dtensor::init_device_mesh("cpu", {hp_test::world_size()}, {"dp"}))
      .reduce_bucket_cap_bytes(cap);
}

// What a run leaves: every parameter whole and every shard's gradient of the last step.
struct Trained {
  std::vector<at::Tensor> params, grads;
};

// `steps` AdamW steps of `net`, each minimizing loss_of_step(step).
void train_steps(torch::nn::Module& net, int64_t steps,
                 const std::function<at::Tensor(int64_t)>& loss_of_step) {
  torch::optim::AdamW opt(net.parameters(), torch::optim::AdamWOptions(1e-2));
  for (int64_t s = 0; s < steps; ++s) {
    opt.zero_grad();
    loss_of_step(s).backward();
    opt.step();
  }
}

// Every parameter of `net` whole, from the shards.
std::vector<at::Tensor> full_params(torch::nn::Module& net) {
  std::vector<at::Tensor> out;
  for (const auto& p : net.parameters()) out.push_back(hp::tensor_parallel::full_tensor(p));
  return out;
}

void expect_same_params(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].equal(b[i])) << "parameter " << i;
}

// AdamW steps; step 1 skips the spare layers, step 2 freezes first.up's bias, step 3 unfreezes it.
// `hook_down`: second.down.weight has a gradient hook (doubling it) from the start.
Trained train(int64_t cap, int64_t steps, bool hook_down = false) {
  Net net;
  shard(net, with_cap(cap));
  if (hook_down) net.second->down->weight.register_hook([](const at::Tensor& g) { return g * 2; });
  train_steps(net, steps, [&](int64_t s) {
    net.first->up->bias.requires_grad_(s != 2);
    return net.forward(batch(s), /*use_spare=*/s != 1).pow(2).mean();
  });
  Trained out{full_params(net), {}};
  for (const auto& p : net.parameters())
    out.grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return out;
}

void expect_bitwise(const Trained& a, const Trained& b) {
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) {
    EXPECT_TRUE(a.params[i].equal(b.params[i])) << "parameter " << i;
    ASSERT_EQ(a.grads[i].defined(), b.grads[i].defined()) << "gradient " << i;
    if (a.grads[i].defined()) {
      EXPECT_TRUE(a.grads[i].equal(b.grads[i])) << "gradient " << i;
    }
  }
}

// `run` throws an `Error` whose message contains `message`.
template <typename Error = std::exception>
void expect_error(const std::function<void()>& run, const std::string& message) {
  try {
    run();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    return;
  }
  ADD_FAILURE() << "expected an error containing: " << message;
}

// The message of the c10::Error that `run` throws ("" if none).
std::string error_message_of(const std::function<void()>& run) {
  try {
    run();
  } catch (const c10::Error& e) {
    return e.what();
  }
  return "";
}

// Reduce-scatters of one backward (the forward's gathers are not counted).
int64_t reduce_scatters_of_one_step(Net& net, bool use_spare) {
  auto loss = net.forward(batch(0), use_spare).pow(2).mean();
  hp::comm::reset_collective_counts();
  loss.backward();
  return hp::comm::collective_count(CollectiveKind::kReduceScatter);
}

}  // namespace

// A cap of 1 byte: each parameter its own bucket; 600 bytes: a few parameters each; 0 and a cap
// larger than any group: one per group. Six steps cover the first (agreed per op) backward, the
// planned ones, a step without the spare layers (their gradients zeros, at the end of the
// backward) and a frozen then unfrozen bias (a new plan each time).
TEST(ReduceBuckets, TrainBitwiseAsOneReduceScatterPerGroup) {
  const auto fused = train(/*cap=*/0, 6);
  for (int64_t cap : {int64_t{1}, int64_t{600}, int64_t{1} << 30}) {
    SCOPED_TRACE("reduce_bucket_cap_bytes " + std::to_string(cap));
    expect_bitwise(train(cap, 6), fused);
  }
}

TEST(ReduceBuckets, ReferenceTrainingMatchesTheFullBatch) {
  // The fused run itself against one process's full batch (the bitwise test above rests on it).
  const int64_t p = hp_test::world_size();
  Net reference;
  torch::optim::AdamW opt(reference.parameters(), torch::optim::AdamWOptions(1e-2));
  for (int64_t s = 0; s < 4; ++s) {
    reference.first->up->bias.requires_grad_(s != 2);
    opt.zero_grad();
    at::manual_seed(200 + s);
    reference.forward(at::randn({p * kRowsPerRank, kIn}), s != 1).pow(2).mean().backward();
    opt.step();
  }
  const auto trained = train(/*cap=*/1, 4);
  const auto ref = reference.parameters();
  for (size_t i = 0; i < ref.size(); ++i)
    hp_test::expect_close(trained.params[i], ref[i].detach(), "parameter " + std::to_string(i));
}

// Exact counts: one reduce-scatter per parameter with a 1-byte cap, one per group with 0, in the
// first backward and in the planned ones; nothing moves on one rank.
TEST(ReduceBuckets, OneReduceScatterPerBucket) {
  const int64_t moves = hp_test::world_size() > 1 ? 1 : 0;
  for (int64_t cap : {int64_t{0}, int64_t{1}}) {
    SCOPED_TRACE("reduce_bucket_cap_bytes " + std::to_string(cap));
    Net net;
    shard(net, with_cap(cap));
    const int64_t expected = moves * (cap == 0 ? kGroups : kParams);
    for (int pass = 0; pass < 3; ++pass)
      EXPECT_EQ(reduce_scatters_of_one_step(net, /*use_spare=*/pass != 1), expected) << "pass " << pass;
  }
}

// The first bucket of the second block leaves before the first block's backward begins, and,
// with the cap at 1 byte, before the second block's own `up` has its gradient; with a cap of 0
// the group's one reduce-scatter waits for the whole group.
TEST(ReduceBuckets, ABucketLeavesWhileItsGroupsBackwardRuns) {
  if (hp_test::world_size() == 1) GTEST_SKIP() << "one rank reduces nothing";
  for (int64_t cap : {int64_t{0}, int64_t{1}}) {
    SCOPED_TRACE("reduce_bucket_cap_bytes " + std::to_string(cap));
    Net net;
    shard(net, with_cap(cap));
    for (int pass = 0; pass < 2; ++pass) {
      int64_t started_before_up = -1;
      auto x = net.first->forward(batch(pass), false);
      auto hidden = net.second->up(x);
      // The gradient of `up`'s output is ready after down's and spare's gradients, before up's.
      hidden.register_hook([&](const at::Tensor& g) {
        started_before_up = hp::comm::collective_count(CollectiveKind::kReduceScatter);
        return g;
      });
      auto y = x + net.second->down(at::relu(hidden));
      auto loss = net.head(net.second->spare(y)).pow(2).mean();
      hp::comm::reset_collective_counts();
      loss.backward();
      // The root group (head) is done by then; the second block has sent down's and spare's
      // weights and biases in buckets of their own, or nothing yet.
      EXPECT_EQ(started_before_up, cap == 0 ? 1 : 2 + 4) << "pass " << pass;
    }
  }
}

// A first backward that fails part-way, after the second block's first buckets started: their
// transfers finish and are dropped, and the next backwards train bitwise as one reduce-scatter per
// group does after the same failure (no half-recorded plan is left behind).
TEST(ReduceBuckets, ABackwardThatFailsPartWayLeavesNoHalfPlan) {
  std::vector<std::vector<at::Tensor>> params;
  for (int64_t cap : {int64_t{0}, int64_t{1}}) {
    SCOPED_TRACE("reduce_bucket_cap_bytes " + std::to_string(cap));
    Net net;
    shard(net, with_cap(cap));
    {
      auto x = net.first->forward(batch(9), true);
      auto hidden = net.second->up(x);
      hidden.register_hook([](const at::Tensor&) -> at::Tensor { throw std::runtime_error("stop here"); });
      auto loss = net.head(net.second->spare(x + net.second->down(at::relu(hidden)))).pow(2).mean();
      EXPECT_THROW(loss.backward(), std::exception);
    }
    train_steps(net, 3, [&](int64_t s) { return net.forward(batch(s)).pow(2).mean(); });
    params.push_back(full_params(net));
  }
  expect_same_params(params[0], params[1]);
}

// A parameter with gradient hooks ends its bucket and gets its reduced gradient through autograd,
// which runs the hooks: bitwise the one-node reduction, over planned backwards too. A hook
// registered after the forward is an error naming the parameter.
TEST(ReduceBuckets, HooksSeeTheReducedGradient) {
  std::vector<std::vector<at::Tensor>> runs;
  for (int64_t cap : {int64_t{0}, int64_t{1}, int64_t{1} << 30}) {
    SCOPED_TRACE("reduce_bucket_cap_bytes " + std::to_string(cap));
    Net net;
    shard(net, with_cap(cap));
    net.second->down->weight.register_hook([](const at::Tensor& g) { return g * 2; });
    std::vector<at::Tensor> seen;
    net.second->spare->bias.register_hook([&seen](const at::Tensor& g) {
      seen.push_back(g.clone());
      return at::Tensor();
    });
    for (int64_t s = 0; s < 3; ++s) {
      for (auto& p : net.parameters()) p.mutable_grad() = at::Tensor();
      net.forward(batch(s)).pow(2).mean().backward();
    }
    ASSERT_EQ(seen.size(), 3u);
    runs.push_back(seen);
    for (const auto& p : net.parameters()) runs.back().push_back(p.grad().clone());
  }
  for (size_t r = 1; r < runs.size(); ++r) {
    for (size_t i = 0; i < runs[0].size(); ++i)
      EXPECT_TRUE(runs[0][i].equal(runs[r][i])) << "run " << r << ", " << i;
  }
  Net net;
  shard(net, with_cap(1));
  auto loss = net.forward(batch(0)).pow(2).mean();
  net.first->up->weight.register_hook([](const at::Tensor& g) { return g; });
  expect_error([&] { loss.backward(); },
               "fully_shard: expected the gradient hooks of up.weight to be registered before the forward");
}

// A layer skipped after the plan was made (step 1): its zeros reduce at its group's first
// gradient, so the bucket that the hooked down.weight ends can start when down.weight arrives
// (it used to wait for spare's zeros at the end of the backward: an error, or a hang on the
// ranks that went on).
TEST(ReduceBuckets, ALayerSkippedAfterThePlanTrainsAsOneReduceScatterPerGroup) {
  const auto fused = train(/*cap=*/0, 4, /*hook_down=*/true);
  for (int64_t cap : {int64_t{1}, int64_t{600}, int64_t{1} << 30}) {
    SCOPED_TRACE("reduce_bucket_cap_bytes " + std::to_string(cap));
    expect_bitwise(train(cap, 4, /*hook_down=*/true), fused);
  }
}

// Two branches computed in either order: the backward's order follows. With a hook on `a`'s
// weight and cap 1, the plan (backward 0: b's gradients, then a's) puts a.weight's bucket after
// b's; when a second forward computes b first, a.weight arrives first and its bucket cannot
// start: an error naming it, on every rank alike (no hang).
struct TwoBranches : torch::nn::Module {
  TwoBranches() {
    a = register_module("a", hp::nn::Linear(kIn, kIn));
    b = register_module("b", hp::nn::Linear(kIn, kIn));
  }
  at::Tensor forward(const at::Tensor& x, bool a_first) {
    if (a_first) {
      auto ya = a(x);
      return ya + b(x);
    }
    auto yb = b(x);
    return a(x) + yb;
  }
  at::Tensor one_branch(const at::Tensor& x, bool use_a) { return use_a ? a(x) : b(x); }
  hp::nn::Linear a{nullptr}, b{nullptr};
};

TEST(ReduceBuckets, AHookedBucketHeldBackByAChangedOrderIsAnError) {
  TwoBranches net;
  fs::fully_shard(net, with_cap(1));
  net.a->weight.register_hook([](const at::Tensor& g) { return g; });
  net.forward(batch(0), /*a_first=*/true).pow(2).mean().backward();
  expect_error(
      [&] { net.forward(batch(1), /*a_first=*/false).pow(2).mean().backward(); },
      "fully_shard: expected the bucket of a.weight (a parameter with gradient hooks) to have started "
      "when its gradient arrived");
}

// Ranks whose first backward reaches different parameters (each uses one of two branches of one
// size) would reduce different buckets of one size against each other: every rank gets an error
// naming their contents before any gradient travels.
TEST(ReduceBuckets, RanksReachingDifferentParametersInTheFirstBackwardGetAnError) {
  if (hp_test::world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  TwoBranches net;
  fs::fully_shard(net, with_cap(1));
  const auto message =
      error_message_of([&] { net.one_branch(batch(0), hp_test::rank() % 2 == 0).pow(2).mean().backward(); });
  EXPECT_NE(message.find("disagree on reduce_scatter"), std::string::npos) << message;
  EXPECT_NE(message.find(" content="), std::string::npos) << message;
}

// Two groups of one size that ranks run in different orders (rank 0 computes branch a first
// after the first step, the others b) would gather and reduce each other's parameters: an error
// on every rank instead, at the first gather out of order.
TEST(ReduceBuckets, GroupsRunInDifferentOrdersByRankAreAnError) {
  if (hp_test::world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  for (int64_t cap : {int64_t{0}, int64_t{1}}) {
    SCOPED_TRACE("reduce_bucket_cap_bytes " + std::to_string(cap));
    auto net = std::make_shared<TwoBranches>();
    fs::fully_shard(*net->a, with_cap(cap));
    fs::fully_shard(*net->b, with_cap(cap));
    fs::fully_shard(*net, with_cap(cap));
    const auto message = error_message_of([&] {
      for (int64_t step = 0; step < 3; ++step) {
        net->forward(batch(step), step == 0 || hp_test::rank() == 0).pow(2).mean().backward();
      }
    });
    EXPECT_NE(message.find("disagree on all_gather"), std::string::npos) << message;
    EXPECT_NE(message.find(" content="), std::string::npos) << message;
  }
}

// A parameter frozen, or hooked, on rank 0 only after the plan was made: rank 0 would make a new
// plan (its buckets agreed per op) while the others follow the old one, each waiting for the
// other. Instead, an error on every rank at the group's gather, before any data moves.
TEST(ReduceBuckets, ParametersFrozenOrHookedOnOneRankOnlyAreAnError) {
  if (hp_test::world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  for (const bool hook : {false, true}) {
    for (int64_t cap : {int64_t{0}, int64_t{1}}) {
      SCOPED_TRACE(std::string(hook ? "hooked" : "frozen") + " on rank 0, cap " + std::to_string(cap));
      Net net;
      shard(net, with_cap(cap));
      const auto message = error_message_of([&] {
        for (int64_t step = 0; step < 2; ++step) {
          if (step == 1 && hp_test::rank() == 0) {
            if (hook) {
              net.first->up->bias.register_hook([](const at::Tensor& g) { return g; });
            } else {
              net.first->up->bias.requires_grad_(false);
            }
          }
          net.forward(batch(step)).pow(2).mean().backward();
        }
      });
      EXPECT_NE(message.find("fully_shard: expected every rank to gather the group (up.weight, up.bias, "
                             "down.weight and 3 more) with the same parameters, sizes, requires_grad flags "
                             "and gradient hooks"),
                std::string::npos)
          << message;
      EXPECT_NE(message.find("disagree on all_gather"), std::string::npos) << message;
    }
  }
}

// After the plan, second's spare layer is reached on even ranks only: the odd ranks' zeros for it
// reduce at second's first gradient, so every rank starts second's buckets before first's, in the
// plan's order (they used to wait for the end of the backward on the odd ranks, after first's:
// buckets paired with another group's). Bitwise one reduce-scatter per group.
TEST(ReduceBuckets, RanksReachingDifferentParametersAfterThePlanTrainAsOneReduceScatterPerGroup) {
  if (hp_test::world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  std::vector<std::vector<at::Tensor>> params;
  for (int64_t cap : {int64_t{0}, int64_t{1}, int64_t{600}}) {
    SCOPED_TRACE("reduce_bucket_cap_bytes " + std::to_string(cap));
    Net net;
    shard(net, with_cap(cap));
    train_steps(net, 3, [&](int64_t s) {
      const bool spare_reached = s == 0 || hp_test::rank() % 2 == 0;
      return net.head(net.second->forward(net.first->forward(batch(s), true), true, spare_reached))
          .pow(2)
          .mean();
    });
    params.push_back(full_params(net));
  }
  expect_same_params(params[0], params[1]);
  expect_same_params(params[0], params[2]);
}

// A forward without grad that skips the spare layers (an evaluation) between training steps
// leaves training as it is: every parameter as without it, bitwise, cap 0 and 1.
TEST(ReduceBuckets, AnEvaluationForwardThatSkipsALayerLeavesTrainingAsItIs) {
  for (int64_t cap : {int64_t{0}, int64_t{1}}) {
    SCOPED_TRACE("reduce_bucket_cap_bytes " + std::to_string(cap));
    std::vector<std::vector<at::Tensor>> runs;
    for (bool evaluate : {false, true}) {
      Net net;
      shard(net, with_cap(cap));
      train_steps(net, 3, [&](int64_t s) {
        if (evaluate) {
          torch::NoGradGuard no_grad;
          net.forward(batch(10 + s), /*use_spare=*/false);
        }
        return net.forward(batch(s)).pow(2).mean();
      });
      runs.push_back(full_params(net));
    }
    expect_same_params(runs[0], runs[1]);
  }
}

// A pass that skipped a layer does not end by itself; when its backward fails after some of the
// group's gradients arrived, the next forward begins a new pass: the training that follows is
// bitwise that of a net without the failed step, caps 0 and 1.
TEST(ReduceBuckets, AFailedBackwardOfAPassThatSkippedALayerLeavesNoOpenPass) {
  for (int64_t cap : {int64_t{0}, int64_t{1}}) {
    SCOPED_TRACE("reduce_bucket_cap_bytes " + std::to_string(cap));
    std::vector<std::vector<at::Tensor>> runs;
    for (bool fail : {false, true}) {
      at::manual_seed(5);
      auto net = std::make_shared<TwoBranches>();
      fs::fully_shard(*net, with_cap(cap));
      if (fail) {
        auto doubled = batch(9).requires_grad_(true) * 2;
        doubled.register_hook([](const at::Tensor&) -> at::Tensor { throw std::runtime_error("stop here"); });
        EXPECT_THROW(net->one_branch(doubled, /*use_a=*/true).pow(2).mean().backward(), std::exception);
      }
      train_steps(*net, 2,
                  [&](int64_t s) { return net->one_branch(batch(s), /*use_a=*/true).pow(2).mean(); });
      runs.push_back(full_params(*net));
    }
    expect_same_params(runs[0], runs[1]);
  }
}

// A group whose parameters are all frozen, with gradients flowing through it, never reduces: only
// its pre-backward runs. Each step's forward still ends its pass when its three modules have run
// (resharded after the forward).
TEST(ReduceBuckets, AFrozenGroupThatGradientsFlowThroughEndsEachForwardPass) {
  Net net;
  shard(net, with_cap(1));
  for (auto& p : net.second->parameters()) p.requires_grad_(false);
  auto group = fs::FSDPModule::of(*net.second)->group();
  constexpr int64_t kSteps = 3;
  for (int64_t s = 0; s < kSteps; ++s) {
    auto loss = net.forward(batch(s)).pow(2).mean();
    EXPECT_FALSE(group->is_unsharded()) << "step " << s;
    loss.backward();
    EXPECT_TRUE(net.first->up->weight.grad().defined());
  }
}

// No sync: nothing moves; the synced backward after two unsynced ones reduces the sum in buckets,
// bitwise as in one reduce-scatter per group.
TEST(ReduceBuckets, GradientAccumulationWithoutSync) {
  std::vector<std::vector<at::Tensor>> grads;
  for (int64_t cap : {int64_t{0}, int64_t{1}}) {
    Net net;
    shard(net, with_cap(cap));
    auto root = fs::FSDPModule::of(net);
    for (int64_t m = 0; m < 3; ++m) {
      root->set_requires_gradient_sync(m == 2);
      hp::comm::reset_collective_counts();
      net.forward(batch(m)).pow(2).mean().backward();
      if (m < 2) {
        EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kReduceScatter), 0);
      }
    }
    grads.emplace_back();
    for (const auto& p : net.parameters()) grads.back().push_back(p.grad().clone());
  }
  for (size_t i = 0; i < grads[0].size(); ++i)
    EXPECT_TRUE(grads[0][i].equal(grads[1][i])) << "gradient " << i;
}

namespace {

// Micro-batch `m`'s global batch, and this rank's rows of a global batch.
at::Tensor full_batch(int64_t m) {
  at::manual_seed(200 + m);
  return at::randn({hp_test::world_size() * kRowsPerRank, kIn});
}
at::Tensor rows_of_this_rank(const at::Tensor& global) {
  return global.narrow(0, hp_test::rank() * kRowsPerRank, kRowsPerRank);
}

// `net`'s gradients, gathered, are the one-process `reference`'s (both absent where it has none).
void expect_gradients_like(torch::nn::Module& net, torch::nn::Module& reference, const std::string& what) {
  const auto listed = hp::tensor_parallel::full_named_parameters(net, /*gradients=*/true);
  const std::map<std::string, at::Tensor> grads(listed.begin(), listed.end());
  for (const auto& item : reference.named_parameters()) {
    const auto& expected = item.value().grad();
    const auto it = grads.find(item.key());
    ASSERT_EQ(it != grads.end(), expected.defined()) << what << ", " << item.key();
    if (expected.defined()) hp_test::expect_close(it->second, expected, what + ", " + item.key());
  }
}

}  // namespace

// Groups of their own for the spare layers, which the synced micro-batch skips: the sums that the
// unsynced micro-batches left in them are reduce-scattered at the end of the synced backward, so
// the step sees every micro-batch (they used to wait for a later synced backward that reached
// them, and be added to its step). The next step's gradients hold only its own micro-batch.
TEST(ReduceBuckets, SumsOfAGroupTheSyncedBackwardDoesNotReachAreReducedWithIt) {
  const int64_t p = hp_test::world_size();
  for (int64_t cap : {int64_t{0}, int64_t{1}}) {
    SCOPED_TRACE("reduce_bucket_cap_bytes " + std::to_string(cap));
    Net reference, net;
    fs::fully_shard(*net.first->spare, with_cap(cap));
    fs::fully_shard(*net.second->spare, with_cap(cap));
    shard(net, with_cap(cap));
    auto root = fs::FSDPModule::of(net);
    for (int64_t m = 0; m < 3; ++m) {
      const bool use_spare = m < 2;
      reference.forward(full_batch(m), use_spare).pow(2).mean().backward();
      root->set_requires_gradient_sync(m == 2);
      hp::comm::reset_collective_counts();
      net.forward(rows_of_this_rank(full_batch(m)), use_spare).pow(2).mean().backward();
    }
    // cap 0: one reduce-scatter per group, the two the synced backward did not reach included.
    const int64_t reduce_scatters = hp::comm::collective_count(CollectiveKind::kReduceScatter);
    if (cap == 0) {
      EXPECT_EQ(reduce_scatters, p > 1 ? kGroups + 2 : 0);
    }
    expect_gradients_like(net, reference, "three micro-batches");
    reference.zero_grad();
    net.zero_grad();
    reference.forward(full_batch(3)).pow(2).mean().backward();
    net.forward(rows_of_this_rank(full_batch(3))).pow(2).mean().backward();
    expect_gradients_like(net, reference, "the next step");
  }
}

// The same across roots: two models, each its own fully_shard root, `side` used only in the
// unsynced micro-batches. The synced backward reaches only `main`, and reduces side's sums at its
// end.
TEST(ReduceBuckets, SumsOfARootTheSyncedBackwardDoesNotReachAreReducedWithIt) {
  for (int64_t cap : {int64_t{0}, int64_t{1}}) {
    SCOPED_TRACE("reduce_bucket_cap_bytes " + std::to_string(cap));
    Net reference_main, reference_side, main, side;
    shard(main, with_cap(cap));
    shard(side, with_cap(cap));
    auto loss = [](Net& a, Net& b, const at::Tensor& x, bool use_b) {
      auto y = a.forward(x);
      return (use_b ? y + b.forward(x) : y).pow(2).mean();
    };
    for (int64_t m = 0; m < 3; ++m) {
      loss(reference_main, reference_side, full_batch(m), m < 2).backward();
      fs::FSDPModule::of(main)->set_requires_gradient_sync(m == 2);
      fs::FSDPModule::of(side)->set_requires_gradient_sync(m == 2);
      loss(main, side, rows_of_this_rank(full_batch(m)), m < 2).backward();
    }
    expect_gradients_like(main, reference_main, "main, three micro-batches");
    expect_gradients_like(side, reference_side, "side, three micro-batches");
    for (auto* net : {&reference_main, &reference_side, &main, &side}) net->zero_grad();
    loss(reference_main, reference_side, full_batch(3), false).backward();
    loss(main, side, rows_of_this_rank(full_batch(3)), false).backward();
    expect_gradients_like(main, reference_main, "main, the next step");
    expect_gradients_like(side, reference_side, "side, the next step (no gradient)");
  }
}

// A hooked parameter that the synced backward does not reach (used only in the unsynced
// micro-batches, or reached only on other ranks) still has its hooks run once on its reduced
// gradient, as in one reduce-scatter per group.
TEST(ReduceBuckets, HooksOfAParameterTheSyncedBackwardDoesNotReachSeeItsReducedGradient) {
  const int64_t r = hp_test::rank();
  // In the synced micro-batch, the spare layers are skipped on every rank, or run on every rank
  // and reached by the backward on the even ones only.
  for (const bool even_ranks_reach_spare : {false, true}) {
    for (int64_t cap : {int64_t{0}, int64_t{1}}) {
      SCOPED_TRACE("cap " + std::to_string(cap) + (even_ranks_reach_spare ? ", even ranks reach spare" : ""));
      std::vector<std::vector<at::Tensor>> grads;
      int64_t hook_calls = 0;
      for (const bool hooked : {false, true}) {
        Net net;
        shard(net, with_cap(cap));
        if (hooked) {
          net.second->spare->weight.register_hook([&hook_calls](const at::Tensor& g) {
            ++hook_calls;
            return g * 2;
          });
        }
        auto root = fs::FSDPModule::of(net);
        net.forward(batch(0)).pow(2).mean().backward();  // the plan: every parameter reached
        for (auto& p : net.parameters()) p.mutable_grad() = at::Tensor();
        hook_calls = 0;
        for (int64_t m = 0; m < 3; ++m) {
          root->set_requires_gradient_sync(m == 2);
          const bool use_spare = m < 2 || even_ranks_reach_spare;
          const bool spare_reached = m < 2 || r % 2 == 0;
          net.forward(batch(1 + m), use_spare, spare_reached).pow(2).mean().backward();
        }
        grads.emplace_back();
        for (const auto& p : net.parameters()) grads.back().push_back(p.grad().clone());
      }
      EXPECT_EQ(hook_calls, 1);
      const auto names = Net().named_parameters().keys();
      for (size_t i = 0; i < names.size(); ++i) {
        const auto want = names[i] == "second.spare.weight" ? grads[0][i] * 2 : grads[0][i];
        EXPECT_TRUE(grads[1][i].equal(want)) << names[i];
      }
    }
  }
}

// Two sequence-parallel norms over tp, fully_shard over dp: each norm's read sums the gradient of
// its forward over tp, in each micro-batch's backward. The spare norm is used only in the unsynced
// micro-batches, so the synced backward does not reach it: its held sum is reduced there.
struct SequenceParallelNorms : torch::nn::Module {
  SequenceParallelNorms() {
    at::manual_seed(13);
    norm = register_module("norm", hp::nn::RMSNorm(kIn));
    spare = register_module("spare", hp::nn::RMSNorm(kIn));
    at::NoGradGuard no_grad;
    norm->weight.uniform_(0.5, 1.5);
    spare->weight.uniform_(0.5, 1.5);
  }
  at::Tensor forward(const at::Tensor& x, bool use_spare) {
    auto h = norm(x);
    return use_spare ? spare(h) : h;
  }
  hp::nn::RMSNorm norm{nullptr}, spare{nullptr};
};

// Micro-batch `m` of data-parallel replica `replica`, the whole sequence: 4 tokens per tp rank.
at::Tensor norm_batch(int64_t m, int64_t replica, int64_t tp) {
  at::manual_seed(300 + 10 * m + replica);
  return at::randn({2, 4 * tp, kIn});
}

TEST(ReduceBuckets, ASequenceParallelWeightUsedOnlyWithoutSyncIsSummedOverTP) {
  if (hp_test::world_size() != 4) GTEST_SKIP() << "a 2 x 2 (dp, tp) mesh needs 4 ranks";
  auto mesh = hp::dtensor::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
  const int64_t replica = hp_test::rank() / 2, tp_rank = hp_test::rank() % 2;
  auto micro_batches = [&](SequenceParallelNorms& net, bool sharded) {
    for (int64_t m = 0; m < 3; ++m) {
      if (sharded) fs::FSDPModule::of(net)->set_requires_gradient_sync(m == 2);
      for (int64_t d = 0; d < 2; ++d) {
        if (sharded && d != replica) continue;
        auto x = norm_batch(m, d, 2);
        if (sharded) x = x.narrow(1, tp_rank * 4, 4);
        net.forward(x, /*use_spare=*/m < 2).pow(2).sum().div(sharded ? 1 : 2).backward();
      }
    }
  };
  // Reference: one process, the whole sequence, the mean over the replicas.
  SequenceParallelNorms reference;
  micro_batches(reference, false);
  std::vector<std::vector<at::Tensor>> grads;
  for (int64_t cap : {int64_t{0}, int64_t{1}}) {
    SCOPED_TRACE("cap " + std::to_string(cap));
    SequenceParallelNorms net;
    hp::tensor_parallel::parallelize_module(*net.norm, mesh["tp"], hp::tensor_parallel::SequenceParallel());
    hp::tensor_parallel::parallelize_module(*net.spare, mesh["tp"], hp::tensor_parallel::SequenceParallel());
    fs::fully_shard(net, fs::FullyShardOptions().mesh(mesh["dp"]).reduce_bucket_cap_bytes(cap));
    net.forward(norm_batch(9, replica, 2).narrow(1, tp_rank * 4, 4), true).sum().backward();  // the plan
    for (auto& p : net.parameters()) p.mutable_grad() = at::Tensor();
    micro_batches(net, true);
    grads.emplace_back();
    for (const auto& p : net.parameters()) grads.back().push_back(p.grad().clone());
    // This rank's shard (dim 0 over dp) of the reference's gradients.
    const auto want = reference.spare->weight.grad().narrow(0, replica * (kIn / 2), kIn / 2);
    EXPECT_TRUE(at::allclose(grads.back()[1], want, 1e-5, 1e-5)) << grads.back()[1] << " against " << want;
  }
  for (size_t i = 0; i < grads[0].size(); ++i)
    EXPECT_TRUE(grads[0][i].equal(grads[1][i])) << "gradient " << i;
}

// HSDP: each bucket's reduce-scatter over the shard dim, then its all-reduce over replicate.
TEST(ReduceBuckets, HybridShardingBitwiseAsOneReduceScatterPerGroup) {
  if (hp_test::world_size() != 4) GTEST_SKIP() << "a 2 x 2 (replicate, shard) mesh needs 4 ranks";
  auto mesh = hp::dtensor::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
  std::vector<std::vector<at::Tensor>> params;
  for (int64_t cap : {int64_t{0}, int64_t{1}}) {
    Net net;
    shard(net, fs::FullyShardOptions().mesh(mesh).reduce_bucket_cap_bytes(cap));
    hp::comm::reset_collective_counts();
    train_steps(net, 3, [&](int64_t s) { return net.forward(batch(s)).pow(2).mean(); });
    const int64_t buckets = cap == 0 ? kGroups : kParams;
    EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kReduceScatter), 3 * buckets);
    EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllReduce), 3 * buckets);
    params.push_back(full_params(net));
  }
  expect_same_params(params[0], params[1]);
}

// HSDP, with a hooked parameter that the backward reaches on replica 0 only: replica 0 waits for
// its bucket mid-backward, replica 1 for every bucket at the end. The all-reduces over replicate
// still pair bucket with bucket (each waits for the ones started before it): bitwise one
// reduce-scatter per group.
TEST(ReduceBuckets, HybridShardingWithAHookedParameterReachedOnOneReplicaOnly) {
  if (hp_test::world_size() != 4) GTEST_SKIP() << "a 2 x 2 (replicate, shard) mesh needs 4 ranks";
  auto mesh = hp::dtensor::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
  const bool replica_0 = hp_test::rank() / 2 == 0;
  std::vector<std::vector<at::Tensor>> grads;
  for (int64_t cap : {int64_t{0}, int64_t{1}}) {
    SCOPED_TRACE("reduce_bucket_cap_bytes " + std::to_string(cap));
    Net net;
    shard(net, fs::FullyShardOptions().mesh(mesh).reduce_bucket_cap_bytes(cap));
    net.second->spare->weight.register_hook([](const at::Tensor& g) { return g * 2; });
    grads.emplace_back();
    for (int64_t step = 0; step < 3; ++step) {
      for (auto& p : net.parameters()) p.mutable_grad() = at::Tensor();
      const bool spare_reached = step == 0 || replica_0;  // the first backward (the plan): everywhere
      net.head(net.second->forward(net.first->forward(batch(step), true), true, spare_reached))
          .pow(2)
          .mean()
          .backward();
      for (const auto& p : net.parameters()) grads.back().push_back(p.grad().clone());
    }
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i)
    EXPECT_TRUE(grads[0][i].equal(grads[1][i])) << "gradient " << i;
}

TEST(ReduceBuckets, ANegativeCapIsAValueError) {
  Net net;
  expect_error<c10::ValueError>(
      [&] { fs::fully_shard(*net.first, with_cap(-1)); },
      "expected reduce_bucket_cap_bytes >= 0 (0: one reduce-scatter per group), got -1");
}

// A layer every rank skips in a step (the spare layers, steps 1 and 2): no rank has a gradient
// for it, so its .grad stays as it was (none after zero_grad), as in one process, its hook does
// not run, and AdamW leaves it. They used to get zeros, which AdamW's decay and moments moved.
// One that some ranks reach still averages with the others' zeros (the tests above).
TEST(ReduceBuckets, ALayerEveryRankSkipsKeepsNoGradientAsInOneProcess) {
  for (int64_t cap : {int64_t{0}, int64_t{1}, int64_t{600}}) {
    SCOPED_TRACE("reduce_bucket_cap_bytes " + std::to_string(cap));
    Net reference, net;
    shard(net, with_cap(cap));
    int64_t hook_calls = 0;
    net.second->spare->weight.register_hook([&hook_calls](const at::Tensor& g) {
      ++hook_calls;
      return g;
    });
    torch::optim::AdamW reference_opt(reference.parameters(), torch::optim::AdamWOptions(1e-2));
    torch::optim::AdamW opt(net.parameters(), torch::optim::AdamWOptions(1e-2));
    for (int64_t s = 0; s < 4; ++s) {
      const bool use_spare = s == 0 || s == 3;
      const std::string what = "step " + std::to_string(s);
      reference.zero_grad(/*set_to_none=*/true);
      net.zero_grad(/*set_to_none=*/true);
      reference.forward(full_batch(s), use_spare).pow(2).mean().backward();
      hook_calls = 0;
      net.forward(rows_of_this_rank(full_batch(s)), use_spare).pow(2).mean().backward();
      EXPECT_EQ(hook_calls, use_spare ? 1 : 0) << what;
      expect_gradients_like(net, reference, what);
      reference_opt.step();
      opt.step();
    }
    const auto params = full_params(net), expected = reference.parameters();
    ASSERT_EQ(params.size(), expected.size());
    for (size_t i = 0; i < params.size(); ++i)
      hp_test::expect_close(params[i], expected[i].detach(), "parameter " + std::to_string(i));
  }
}
