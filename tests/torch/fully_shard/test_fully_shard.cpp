// fully_shard against the full-batch single-process reference at world sizes 1, 2, 3 and 4:
// training (AdamW) with reshard_after_forward on and off, HSDP (also with the all-reduce held for
// the last micro-batch), a sum over the ranks in place of the average, gradient accumulation
// without sync, mixed precision, uneven and empty shards; exact collective counts per phase;
// implicit and explicit prefetch; groups gathered right after their own optimizer step; the
// shards' sizes and the optimizer state's; an embedding's row-sparse gather and reduce-scatter,
// bitwise the dense ones, also under a TP style that cuts its vocabulary; the module cast after
// fully_shard; a sequence-parallel norm with a loss term on its weight on a 2 x 2 mesh; every
// error a user can cause.
#include <gtest/gtest.h>

#include <map>
#include <new>
#include <optional>
#include <string>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <hyper_parallel/hyper_parallel.h>

#include "common/test_util.h"

namespace hp = hyper_parallel;
namespace fs = hp::fully_shard;
using hp::comm::CollectiveKind;
using hp::dtensor::DeviceMesh;

namespace {

// Sizes that no world size of the test divides: uneven pieces, and empty ones at 3 and 4 ranks
// for the 2-row head.
constexpr int64_t kIn = 12, kHidden = 20, kOut = 2, kBlocks = 2, kRowsPerRank = 3;

struct Block : torch::nn::Module {
  Block() {
    up = register_module("up", hp::nn::Linear(kIn, kHidden));
    down = register_module("down", hp::nn::Linear(kHidden, kIn));
  }
  at::Tensor forward(const at::Tensor& x) { return x + down(at::relu(up(x))); }
  hp::nn::Linear up{nullptr}, down{nullptr};
};

struct Net : torch::nn::Module {
  Net() {
    at::manual_seed(7);
    for (int64_t i = 0; i < kBlocks; ++i)
      blocks.push_back(register_module("block" + std::to_string(i), std::make_shared<Block>()));
    norm = register_module("norm", hp::nn::RMSNorm(kIn));
    head = register_module("head", hp::nn::Linear(kIn, kOut));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& b : blocks) x = b->forward(x);
    return head(norm(x));
  }
  std::vector<std::shared_ptr<Block>> blocks;
  hp::nn::RMSNorm norm{nullptr};
  hp::nn::Linear head{nullptr};
};

// The global batch of step `step`; rank r's rows are [r * kRowsPerRank, (r + 1) * kRowsPerRank).
at::Tensor batch(int64_t step, int64_t ranks) {
  at::manual_seed(100 + step);
  return at::randn({ranks * kRowsPerRank, kIn});
}

at::Tensor loss_of(const at::Tensor& y) { return y.pow(2).mean(); }

DeviceMesh dp_mesh() { return hp::dtensor::init_device_mesh("cpu", {hp_test::world_size()}, {"dp"}); }

void shard(Net& net, const fs::FullyShardOptions& options) {
  for (auto& b : net.blocks) fs::fully_shard(*b, options);
  fs::fully_shard(net, options);
}

// Every parameter whole, from the shards (checked against the reference).
std::vector<at::Tensor> full_parameters(Net& net) {
  std::vector<at::Tensor> out;
  for (const auto& p : net.parameters()) out.push_back(hp::tensor_parallel::full_tensor(p));
  return out;
}

// `steps` AdamW steps; the losses of the global batch (each rank's mean averaged over ranks).
std::vector<double> train(Net& net, int64_t steps, int64_t rank, int64_t ranks, bool sharded) {
  torch::optim::AdamW opt(net.parameters(), torch::optim::AdamWOptions(1e-2));
  std::vector<double> losses;
  for (int64_t s = 0; s < steps; ++s) {
    auto x = batch(s, ranks);
    if (sharded) x = x.narrow(0, rank * kRowsPerRank, kRowsPerRank);
    opt.zero_grad();
    auto loss = loss_of(net.forward(x));
    loss.backward();
    opt.step();
    auto l = loss.detach().reshape({1});
    if (sharded && ranks > 1) l = hp::comm::all_reduce(l, hp::comm::ReduceOp::kAvg, hp::comm::world());
    losses.push_back(l.item<double>());
  }
  return losses;
}

TEST(FullyShard, TrainsLikeTheFullBatchReference) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  Net reference;
  const auto ref_losses = train(reference, 4, r, p, /*sharded=*/false);
  const auto ref_params = full_parameters(reference);
  for (bool reshard : {true, false}) {
    SCOPED_TRACE(reshard ? "reshard_after_forward" : "kept after forward");
    std::vector<std::vector<double>> runs;
    for (int run = 0; run < 2; ++run) {
      Net net;
      shard(net, fs::FullyShardOptions().mesh(dp_mesh()).reshard_after_forward(reshard));
      runs.push_back(train(net, 4, r, p, /*sharded=*/true));
      const auto params = full_parameters(net);
      for (size_t i = 0; i < params.size(); ++i)
        hp_test::expect_close(params[i], ref_params[i], "parameter " + std::to_string(i));
    }
    for (size_t s = 0; s < ref_losses.size(); ++s) {
      EXPECT_NEAR(runs[0][s], ref_losses[s], 1e-5 * std::abs(ref_losses[s])) << "step " << s;
      EXPECT_EQ(runs[0][s], runs[1][s]) << "step " << s << ": not bitwise run to run";
    }
  }
}

// A forward that throws after a layer's input hook never runs its output hook: the group's call
// stays open. Once the group is freed (reshard), the next forward gathers afresh and trains as
// the reference does.
TEST(FullyShard, AForwardThatThrewDoesNotLeaveFreedParametersToRead) {
  const auto rank = hp_test::rank(), ranks = hp_test::world_size();
  Net reference, net;
  const auto reference_losses = train(reference, 2, rank, ranks, /*sharded=*/false);
  shard(net, fs::FullyShardOptions().mesh(dp_mesh()));
  EXPECT_ANY_THROW(net.forward(at::randn({kRowsPerRank, kIn + 1})));  // up's matmul throws
  fs::FSDPModule::of(*net.blocks[0])->reshard();
  const auto losses = train(net, 2, rank, ranks, /*sharded=*/true);
  for (size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(losses[i], reference_losses[i], 1e-5);
  const auto params = full_parameters(net);
  auto ref = reference.parameters();
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(at::allclose(params[i], ref[i], 1e-5, 1e-6)) << "parameter " << i;
}

// A forward that threw part-way leaves its group gathered and its call open; after an optimizer
// step the next forward gathers the stepped shards, not the parameters left gathered.
TEST(FullyShard, AForwardThatThrewThenAStepGathersTheSteppedShards) {
  const auto rank = hp_test::rank(), ranks = hp_test::world_size();
  for (bool reshard : {true, false}) {
    SCOPED_TRACE(reshard ? "reshard_after_forward" : "kept after forward");
    Net reference, net;
    shard(net, fs::FullyShardOptions().mesh(dp_mesh()).reshard_after_forward(reshard));
    for (Net* m : {&reference, &net}) {
      const bool sharded = m == &net;
      torch::optim::AdamW opt(m->parameters(), torch::optim::AdamWOptions(1e-2));
      for (int64_t s = 0; s < 2; ++s) {
        auto x = batch(s, ranks);
        if (sharded) x = x.narrow(0, rank * kRowsPerRank, kRowsPerRank);
        opt.zero_grad();
        loss_of(m->forward(x)).backward();
        if (s == 0) {
          EXPECT_ANY_THROW(m->forward(at::randn({kRowsPerRank, kIn + 1})));  // up's matmul throws
          opt.step();
        }
      }
    }
    auto ref = reference.parameters(), got = net.parameters();
    for (size_t i = 0; i < got.size(); ++i)
      hp_test::expect_close(hp::tensor_parallel::full_tensor(got[i], got[i].grad()), ref[i].grad(),
                            "gradient " + std::to_string(i));
  }
}

TEST(FullyShard, ShardsParametersAndTheOptimizerState) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  Net full, net;
  shard(net, fs::FullyShardOptions().mesh(dp_mesh()));
  const auto full_params = full.parameters(), params = net.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t rows = full_params[i].size(0);
    EXPECT_EQ(params[i].size(0), hp::comm::chunk_size(rows, p, r)) << "parameter " << i;
    EXPECT_TRUE(
        params[i].equal(full_params[i].narrow(0, hp::comm::chunk_offset(rows, p, r), params[i].size(0))));
  }
  train(net, 1, r, p, true);
  for (const auto& param : net.parameters()) {
    ASSERT_TRUE(param.grad().defined());
    EXPECT_EQ(param.grad().sizes(), param.sizes());
  }
}

// Forward: one all-gather per group. Backward: one more per group when resharded after the
// forward, none otherwise; one reduce-scatter per group. One rank moves nothing.
TEST(FullyShard, OneAllGatherAndOneReduceScatterPerGroup) {
  const int64_t p = hp_test::world_size();
  const int64_t groups = kBlocks + 1;
  for (bool reshard : {true, false}) {
    SCOPED_TRACE(reshard ? "reshard_after_forward" : "kept after forward");
    Net net;
    shard(net, fs::FullyShardOptions().mesh(dp_mesh()).reshard_after_forward(reshard));
    auto x = batch(0, 1);
    hp::comm::reset_collective_counts();
    at::Tensor loss;
    {
      hp::comm::CommRegion region("forward");
      loss = loss_of(net.forward(x));
    }
    {
      hp::comm::CommRegion region("backward");
      loss.backward();
    }
    const int64_t moves = p > 1 ? 1 : 0;
    EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllGather, "forward"), moves * groups);
    EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllGather, "backward"),
              reshard ? moves * groups : 0);
    EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kReduceScatter, "backward"), moves * groups);
    EXPECT_EQ(hp::comm::total_collective_count("forward"), moves * groups);
    EXPECT_EQ(hp::comm::total_collective_count("backward"), moves * groups * (reshard ? 2 : 1));
    // After the backward every group is resharded.
    for (auto& b : net.blocks) EXPECT_FALSE(fs::FSDPModule::of(*b)->group()->is_unsharded());
  }
}

// Implicit prefetch. Forward order: block0, block1, root (norm and head); backward: root,
// block1, block0. From the second pass on, block1's and the root's forward gathers are in flight
// before they run (started by the group before them); block0's is the first of a pass. Each
// backward gather but the root's (the first of the backward) is started by the group whose
// backward came before. No prefetch is stale: the optimizer steps after the backward used them.
TEST(FullyShard, PrefetchStartsTheNextGroupsGatherBeforeItIsNeeded) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  if (p == 1) GTEST_SKIP() << "one rank gathers at once: nothing travels";
  constexpr int64_t kSteps = 3;
  for (bool reshard : {true, false}) {
    SCOPED_TRACE(reshard ? "reshard_after_forward" : "kept after forward");
    Net net;
    shard(net, fs::FullyShardOptions().mesh(dp_mesh()).reshard_after_forward(reshard));
    train(net, kSteps, r, p, /*sharded=*/true);
    const int64_t backward = reshard ? kSteps : 0;  // the first forward learns the order
    const std::vector<std::pair<fs::ParamGroup*, int64_t>> expected = {
        {fs::FSDPModule::of(*net.blocks[0])->group(), backward},
        {fs::FSDPModule::of(*net.blocks[1])->group(), kSteps - 1 + backward},
        {fs::FSDPModule::of(net)->group(), kSteps - 1}};
    for (size_t g = 0; g < expected.size(); ++g) {
      const auto stats = expected[g].first->gather_stats();
      EXPECT_EQ(stats.gathers, kSteps * (reshard ? 2 : 1)) << "group " << g;
      EXPECT_EQ(stats.prefetched, expected[g].second) << "group " << g;
      EXPECT_EQ(stats.regathered, 0) << "group " << g;
    }
  }
}

// A root whose first module runs first in the forward and last in the backward (an embedding):
// its late pre-backward must not prefetch a group whose backward is over (that gather would
// travel for nothing and be done again after the optimizer step).
struct InputProjectionNet : torch::nn::Module {
  InputProjectionNet() {
    at::manual_seed(9);
    in = register_module("in", hp::nn::Linear(kIn, kIn));
    for (int64_t i = 0; i < kBlocks; ++i)
      blocks.push_back(register_module("block" + std::to_string(i), std::make_shared<Block>()));
    head = register_module("head", hp::nn::Linear(kIn, kOut));
  }
  at::Tensor forward(at::Tensor x) {
    x = in(x);
    for (auto& b : blocks) x = b->forward(x);
    return head(x);
  }
  hp::nn::Linear in{nullptr}, head{nullptr};
  std::vector<std::shared_ptr<Block>> blocks;
};

TEST(FullyShard, PrefetchGathersEachGroupOncePerUse) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  constexpr int64_t kSteps = 3;
  for (bool reshard : {true, false}) {
    SCOPED_TRACE(reshard ? "reshard_after_forward" : "kept after forward");
    InputProjectionNet net;
    const auto options = fs::FullyShardOptions().mesh(dp_mesh()).reshard_after_forward(reshard);
    for (auto& b : net.blocks) fs::fully_shard(*b, options);
    fs::fully_shard(net, options);
    torch::optim::AdamW opt(net.parameters(), torch::optim::AdamWOptions(1e-2));
    for (int64_t s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      loss_of(net.forward(batch(s, p).narrow(0, r * kRowsPerRank, kRowsPerRank))).backward();
      opt.step();
    }
    for (auto* m : std::vector<torch::nn::Module*>{net.blocks[0].get(), net.blocks[1].get(), &net}) {
      const auto stats = fs::FSDPModule::of(*m)->group()->gather_stats();
      EXPECT_EQ(stats.gathers, kSteps * (reshard ? 2 : 1)) << m->name();
      EXPECT_EQ(stats.regathered, 0) << m->name();
    }
  }
}

// A gather started ahead of its use (unshard(async_op)) whose shards then change in place is
// done again: the forward sees the changed parameters, as a gather started after the change.
TEST(FullyShard, AGatherStartedBeforeAnInPlaceChangeIsDoneAgain) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  Net changed_first, changed_after;
  shard(changed_first, fs::FullyShardOptions().mesh(dp_mesh()));
  shard(changed_after, fs::FullyShardOptions().mesh(dp_mesh()));
  auto change = [](Block& b) {
    at::NoGradGuard no_grad;
    b.up->weight.mul_(0.5);
  };
  change(*changed_first.blocks[0]);
  auto handle = fs::FSDPModule::of(*changed_after.blocks[0]);
  handle->unshard(/*async_op=*/true);
  change(*changed_after.blocks[0]);
  const auto x = batch(0, p).narrow(0, r * kRowsPerRank, kRowsPerRank);
  at::NoGradGuard no_grad;
  EXPECT_TRUE(changed_after.forward(x).equal(changed_first.forward(x)));
  EXPECT_EQ(handle->group()->gather_stats().regathered, 1);
  // unshard(async_op) then wait_for_unshard: gathered, and the next forward uses it.
  auto block1 = fs::FSDPModule::of(*changed_after.blocks[1]);
  block1->reshard();
  block1->unshard(/*async_op=*/true);
  block1->wait_for_unshard();
  EXPECT_TRUE(block1->group()->is_unsharded());
}

// A shard changed in place between a forward and its backward (an optimizer step, a load): the
// backward would pair the forward's activations with other values; an error there, as torch's
// version check, after which training goes on.
TEST(FullyShard, AShardChangedBetweenAForwardAndItsBackwardIsAnError) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  for (const bool reshard : {true, false}) {
    Block block;
    fs::fully_shard(block, fs::FullyShardOptions().mesh(dp_mesh()).reshard_after_forward(reshard));
    const auto x = batch(0, p).narrow(0, r * kRowsPerRank, kRowsPerRank);
    auto pending = loss_of(block.forward(x));
    {
      at::NoGradGuard no_grad;
      block.down->weight.mul_(0.5);
    }
    HP_EXPECT_THROW_MSG(pending.backward(),
                        "unchanged from a forward to its backward, got down.weight changed");
    loss_of(block.forward(x)).backward();
    EXPECT_TRUE(block.down->weight.grad().defined());
  }
}

// The module cast after fully_shard (module->to(dtype), as FSDP2 allows): the group gathers in
// the shards' new dtype and trains as the reference cast alike, to float64's precision (a block:
// Net's RMSNorm computes in float32); a cast between a forward and its backward is an error at
// the backward, after which training goes on.
TEST(FullyShard, AModuleCastAfterFullyShardTrainsLikeTheReferenceCastAlike) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  at::manual_seed(7);
  Block reference;
  at::manual_seed(7);
  Block block;
  fs::fully_shard(block, fs::FullyShardOptions().mesh(dp_mesh()));
  auto pending = loss_of(block.forward(batch(0, p).narrow(0, r * kRowsPerRank, kRowsPerRank)));
  block.to(at::kDouble);
  HP_EXPECT_THROW_MSG(pending.backward(),
                      "to keep the dtype and device their forward read them in until its backward");
  pending = at::Tensor();
  reference.to(at::kDouble);
  torch::optim::AdamW ref_opt(reference.parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt(block.parameters(), torch::optim::AdamWOptions(1e-2));
  for (int64_t s = 0; s < 3; ++s) {
    const auto x = batch(s, p).to(at::kDouble);
    for (auto [module, optimizer, input] :
         {std::tuple<Block*, torch::optim::AdamW*, at::Tensor>{&reference, &ref_opt, x},
          {&block, &opt, x.narrow(0, r * kRowsPerRank, kRowsPerRank)}}) {
      optimizer->zero_grad();
      loss_of(module->forward(input)).backward();
      optimizer->step();
    }
  }
  const auto params = block.parameters(), ref_params = reference.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].scalar_type(), at::kDouble) << "parameter " << i;
    hp_test::expect_close(hp::tensor_parallel::full_tensor(params[i]), ref_params[i].detach(),
                          "parameter " + std::to_string(i));
  }
}

// One optimizer per group, stepped in the forward's order, with the first groups gathered for
// the next step right after their own step (unshard(async_op) beside the other groups' steps):
// the same training as one optimizer, bit for bit, and those gathers are the forward's, read
// after the step (none done again, none added but the last step's).
TEST(FullyShard, GroupsGatheredRightAfterTheirOwnStepTrainLikeOneOptimizer) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  constexpr int64_t kSteps = 3;
  for (bool reshard : {true, false}) {
    SCOPED_TRACE(reshard ? "reshard_after_forward" : "kept after forward");
    const auto options = fs::FullyShardOptions().mesh(dp_mesh()).reshard_after_forward(reshard);
    Net one, early;
    shard(one, options);
    shard(early, options);
    const std::vector<fs::FSDPModule> order{*fs::FSDPModule::of(early), *fs::FSDPModule::of(*early.blocks[0]),
                                            *fs::FSDPModule::of(*early.blocks[1])};
    std::vector<std::unique_ptr<torch::optim::AdamW>> per_group;
    for (const auto& m : order) {
      per_group.push_back(
          std::make_unique<torch::optim::AdamW>(m.group()->parameters(), torch::optim::AdamWOptions(1e-2)));
    }
    torch::optim::AdamW opt(one.parameters(), torch::optim::AdamWOptions(1e-2));
    for (int64_t s = 0; s < kSteps; ++s) {
      const auto x = batch(s, p).narrow(0, r * kRowsPerRank, kRowsPerRank);
      opt.zero_grad();
      for (auto& o : per_group) o->zero_grad();
      const auto loss_one = loss_of(one.forward(x)), loss_early = loss_of(early.forward(x));
      EXPECT_TRUE(loss_early.equal(loss_one)) << "step " << s;
      loss_one.backward();
      loss_early.backward();
      opt.step();
      for (size_t g = 0; g < order.size(); ++g) {
        per_group[g]->step();
        if (g < 2) order[g].unshard(/*async_op=*/true);  // the root and block 0: needed first
      }
    }
    const auto params = full_parameters(early), ref = full_parameters(one);
    for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(params[i].equal(ref[i])) << "parameter " << i;
    for (size_t g = 0; g < order.size(); ++g) {
      const auto stats = order[g].group()->gather_stats();
      const int64_t per_step = reshard ? 2 : 1, after_last = g < 2 ? 1 : 0;
      EXPECT_EQ(stats.gathers, kSteps * per_step + after_last) << "group " << g;
      EXPECT_EQ(stats.regathered, 0) << "group " << g;
      if (g < 2 && p > 1) {  // a group of one rank has nothing in flight
        EXPECT_GE(stats.prefetched, kSteps - 1) << "group " << g;
      }
    }
  }
}

// A gradient hook on a shard sees the reduced shard gradient and what it returns is accumulated:
// here it doubles it.
TEST(FullyShard, GradientHooksOnShardsRun) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  Net plain, hooked;
  shard(plain, fs::FullyShardOptions().mesh(dp_mesh()));
  shard(hooked, fs::FullyShardOptions().mesh(dp_mesh()));
  hooked.blocks[1]->up->weight.register_hook([](const at::Tensor& g) { return g * 2; });
  const auto x = batch(0, p).narrow(0, r * kRowsPerRank, kRowsPerRank);
  loss_of(plain.forward(x)).backward();
  loss_of(hooked.forward(x)).backward();
  EXPECT_TRUE(hooked.blocks[1]->up->weight.grad().equal(plain.blocks[1]->up->weight.grad() * 2));
  EXPECT_TRUE(hooked.blocks[0]->up->weight.grad().equal(plain.blocks[0]->up->weight.grad()));
}

// HSDP on a (replicate, shard) mesh: a reduce-scatter over shard, then an all-reduce over
// replicate, per group; the same training as the reference.
TEST(FullyShard, HybridShardingTrainsLikeTheReference) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  if (p != 4) GTEST_SKIP() << "a 2 x 2 (replicate, shard) mesh needs 4 ranks";
  auto mesh = hp::dtensor::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
  Net reference, net;
  shard(net, fs::FullyShardOptions().mesh(mesh));
  const auto ref_losses = train(reference, 3, r, p, false);
  hp::comm::reset_collective_counts();
  const auto losses = train(net, 3, r, p, true);
  for (size_t s = 0; s < losses.size(); ++s)
    EXPECT_NEAR(losses[s], ref_losses[s], 1e-5 * std::abs(ref_losses[s]));
  const auto params = full_parameters(net), ref = full_parameters(reference);
  for (size_t i = 0; i < params.size(); ++i)
    hp_test::expect_close(params[i], ref[i], "parameter " + std::to_string(i));
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kReduceScatter), 3 * (kBlocks + 1));
  // The HSDP all-reduces, and one per step for the loss logged above.
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllReduce), 3 * (kBlocks + 1) + 3);
}

// set_requires_all_reduce(false) on HSDP: micro-batch 0 without sync (no communication), 1 and 2
// reduce-scatter into held sums without the all-reduce and leave .grad as it was; 3 all-reduces
// them with its own: the gradient of all four micro-batches, one all-reduce per group.
TEST(FullyShard, HybridShardingWithoutAllReduceHoldsReduceScattersForTheLastMicrobatch) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  if (p != 4) GTEST_SKIP() << "a 2 x 2 (replicate, shard) mesh needs 4 ranks";
  auto mesh = hp::dtensor::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
  for (const int64_t cap : {int64_t{0}, int64_t{256}}) {  // one reduction per group, or buckets
    Net reference, net;
    shard(net, fs::FullyShardOptions().mesh(mesh).reduce_bucket_cap_bytes(cap));
    const auto root = fs::FSDPModule::of(net).value();
    int64_t reductions = cap == 0 ? kBlocks + 1 : -1;  // the buckets: as the first synced backward made
    for (int64_t m = 0; m < 4; ++m) {
      loss_of(reference.forward(batch(m, p))).backward();
      root.set_requires_gradient_sync(m > 0);
      root.set_requires_all_reduce(m == 3);
      hp::comm::reset_collective_counts();
      loss_of(net.forward(batch(m, p).narrow(0, r * kRowsPerRank, kRowsPerRank))).backward();
      const std::string at = "micro-batch " + std::to_string(m) + ", cap " + std::to_string(cap);
      const auto reduce_scatters = hp::comm::collective_count(CollectiveKind::kReduceScatter);
      if (reductions < 0 && m == 1) reductions = reduce_scatters;
      EXPECT_EQ(reduce_scatters, m > 0 ? reductions : 0) << at;
      EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllReduce), m == 3 ? reductions : 0) << at;
      if (m < 3) {
        for (const auto& param : net.parameters()) EXPECT_FALSE(param.grad().defined()) << at;
      }
      // The held sums were reduce-scattered with the average: the op stays until they are reduced.
      if (m > 0 && m < 3) {
        HP_EXPECT_THROW_MSG(root.set_reduce_op(hp::comm::ReduceOp::kSum),
                            "got a change from avg to sum while it holds some");
      }
    }
    if (cap > 0) {
      EXPECT_GT(reductions, kBlocks + 1) << "buckets";
    }
    const auto ref = reference.parameters();
    const auto grads = hp::tensor_parallel::full_named_parameters(net, /*gradients=*/true);
    ASSERT_EQ(grads.size(), ref.size());
    for (size_t i = 0; i < ref.size(); ++i)
      hp_test::expect_close(grads[i].second, ref[i].grad(), grads[i].first);
  }
}

// set_reduce_op(kSum) on every group: the gradients add up over the data-parallel ranks (the
// reference's, dp times), on a 1-d mesh and, at 4 ranks, on a 2 x 2 HSDP mesh.
TEST(FullyShard, ReduceOpSumAddsTheDataParallelRanksGradientsUp) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  std::vector<DeviceMesh> meshes{dp_mesh()};
  if (p == 4) meshes.push_back(hp::dtensor::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"}));
  for (const auto& mesh : meshes) {
    Net reference, net;
    shard(net, fs::FullyShardOptions().mesh(mesh));
    for (auto& b : net.blocks) fs::FSDPModule::of(*b)->set_reduce_op(hp::comm::ReduceOp::kSum);
    fs::FSDPModule::of(net)->set_reduce_op(hp::comm::ReduceOp::kSum);
    loss_of(reference.forward(batch(0, p))).backward();
    loss_of(net.forward(batch(0, p).narrow(0, r * kRowsPerRank, kRowsPerRank))).backward();
    const auto ref = reference.parameters();
    const auto grads = hp::tensor_parallel::full_named_parameters(net, /*gradients=*/true);
    for (size_t i = 0; i < ref.size(); ++i)
      hp_test::expect_close(grads[i].second, ref[i].grad() * static_cast<double>(p), grads[i].first);
  }
}

// FSDP2's set_gradient_divide_factor (not recursive): the root's group sums over every dp rank
// and divides by the factor; the blocks keep the average.
TEST(FullyShard, GradientDivideFactorDividesTheRanksSum) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  std::vector<DeviceMesh> meshes{dp_mesh()};
  if (p == 4) meshes.push_back(hp::dtensor::init_device_mesh("cpu", {2, 2}, {"replicate", "shard"}));
  for (const auto& mesh : meshes) {
    Net reference, net;
    shard(net, fs::FullyShardOptions().mesh(mesh));
    fs::FSDPModule::of(net)->set_gradient_divide_factor(3.0);
    loss_of(reference.forward(batch(0, p))).backward();
    loss_of(net.forward(batch(0, p).narrow(0, r * kRowsPerRank, kRowsPerRank))).backward();
    const auto ref = reference.parameters();
    const auto grads = hp::tensor_parallel::full_named_parameters(net, /*gradients=*/true);
    for (size_t i = 0; i < ref.size(); ++i) {
      const double factor = grads[i].first.rfind("block", 0) == 0 ? 1.0 : static_cast<double>(p) / 3.0;
      hp_test::expect_close(grads[i].second, ref[i].grad() * factor, grads[i].first);
    }
  }
  Net net;
  shard(net, fs::FullyShardOptions().mesh(dp_mesh()));
  HP_EXPECT_THROW_MSG(fs::FSDPModule::of(net)->set_gradient_divide_factor(0.0),
                      "set_gradient_divide_factor: expected a finite number > 0, got 0");
}

// On a 1-d mesh a reduce-scatter completes the gradient: all_reduce off changes nothing.
TEST(FullyShard, RequiresAllReduceOffOnA1dMeshWritesTheGradientsAsBefore) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  Net reference, net;
  auto root = fs::fully_shard(net, fs::FullyShardOptions().mesh(dp_mesh()));
  root.set_requires_all_reduce(false);
  loss_of(reference.forward(batch(0, p))).backward();
  loss_of(net.forward(batch(0, p).narrow(0, r * kRowsPerRank, kRowsPerRank))).backward();
  const auto ref = reference.parameters();
  const auto grads = hp::tensor_parallel::full_named_parameters(net, /*gradients=*/true);
  for (size_t i = 0; i < ref.size(); ++i)
    hp_test::expect_close(grads[i].second, ref[i].grad(), grads[i].first);
}

// A sequence-parallel norm on a 2 x 2 (dp, tp) mesh, under fully_shard: the gradient of the
// norm's forward (each tp rank's tokens) is summed over tp before fully_shard reduces it over dp;
// a loss term on the norm's weight, which every rank computes alike, counts once.
struct NormThenColumn : torch::nn::Module {
  NormThenColumn() {
    at::manual_seed(11);
    norm = register_module("norm", hp::nn::RMSNorm(kIn));
    proj = register_module("proj", hp::nn::Linear(kIn, kOut));
    at::NoGradGuard no_grad;
    norm->weight.uniform_(0.5, 1.5);  // away from ones, so a wrong penalty gradient shows
  }
  at::Tensor forward(const at::Tensor& x) { return proj(norm(x)); }
  at::Tensor penalty() { return 0.1 * norm->weight.pow(2).sum(); }
  hp::nn::RMSNorm norm{nullptr};
  hp::nn::Linear proj{nullptr};
};

TEST(FullyShard, ASequenceParallelNormsLossTermCountsOnceOnA2DMesh) {
  namespace tp = hp::tensor_parallel;
  const int64_t p = hp_test::world_size();
  if (p != 4) GTEST_SKIP() << "a 2 x 2 (dp, tp) mesh needs 4 ranks";
  auto mesh = hp::dtensor::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
  const int64_t dp = mesh["dp"].get_local_rank(0), tp_rank = mesh["tp"].get_local_rank(0);
  at::manual_seed(5);
  const auto x = at::randn({2, 2, 2 * kRowsPerRank, kIn});  // (replica, batch, tokens, features)
  NormThenColumn reference, net;
  // The reference: the mean over replicas of the data term, plus the penalty.
  ((reference.forward(x[0]).pow(2).sum() + reference.forward(x[1]).pow(2).sum()) / 2 + reference.penalty())
      .backward();
  tp::parallelize_module(net, mesh["tp"],
                         {{"norm", std::make_shared<tp::SequenceParallel>()},
                          {"proj", std::make_shared<tp::ColwiseParallel>(
                                       tp::ColwiseParallelOptions().input_layouts(hp::dtensor::Shard(1)))}});
  fs::fully_shard(net, fs::FullyShardOptions().mesh(mesh["dp"]));
  const auto mine = x[dp].narrow(1, tp_rank * kRowsPerRank, kRowsPerRank);
  (net.forward(mine).pow(2).sum() + net.penalty()).backward();
  const auto params = net.named_parameters(), ref = reference.named_parameters();
  for (const auto& item : params) {
    hp_test::expect_close(tp::full_tensor(item.value(), item.value().grad()), ref[item.key()].grad(),
                          item.key() + " grad");
  }
}

// Four linears whose second leaves its output row-sharded and tagged (use_local_output=false):
// the third reads that layout through fully_shard's pre-backward node and mixed-precision cast.
struct FourLinears : torch::nn::Module {
  FourLinears() {
    at::manual_seed(3);
    for (int i = 0; i < 4; ++i)
      layers.push_back(
          register_module("l" + std::to_string(i), hp::nn::Linear(i % 2 ? 20 : 12, i % 2 ? 12 : 20)));
  }
  at::Tensor forward(at::Tensor x) {
    for (auto& layer : layers) x = layer(x);
    return x;
  }
  std::vector<hp::nn::Linear> layers;
};

TEST(FullyShard, ALayoutTaggedBetweenModulesCrossesTheirWrappers) {
  namespace tp = hp::tensor_parallel;
  const int64_t p = hp_test::world_size();
  if (p % 2) GTEST_SKIP() << "a (dp, 2) mesh needs an even world size";
  auto mesh = hp::dtensor::init_device_mesh("cpu", {p / 2, 2}, {"dp", "tp"});
  const int64_t dp = mesh["dp"].get_local_rank(0), rows = 4;
  at::manual_seed(5);
  const auto x = at::randn({p / 2 * rows, 12});
  FourLinears reference;
  (reference.forward(x).pow(2).sum() / (p / 2)).backward();
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    FourLinears net;
    tp::parallelize_module(
        net, mesh["tp"],
        {{"l0", std::make_shared<tp::ColwiseParallel>()},
         {"l1",
          std::make_shared<tp::RowwiseParallel>(
              tp::RowwiseParallelOptions().output_layouts(hp::dtensor::Shard(0)).use_local_output(false))},
         {"l2", std::make_shared<tp::ColwiseParallel>()},
         {"l3", std::make_shared<tp::RowwiseParallel>()}});
    const auto options =
        fs::FullyShardOptions()
            .mesh(mesh["dp"])
            .mp_policy(fs::MixedPrecisionPolicy().param_dtype(dtype).reduce_dtype(at::kFloat));
    for (auto& layer : net.layers) fs::fully_shard(*layer, options);
    fs::fully_shard(net, options);
    const auto y = net.forward(x.narrow(0, dp * rows, rows));
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{rows, 12}));
    hp_test::expect_close(y.to(at::kFloat), reference.forward(x.narrow(0, dp * rows, rows)), "output");
    y.pow(2).sum().backward();
    const auto ref = reference.named_parameters();
    for (const auto& item : net.named_parameters()) {
      hp_test::expect_close(tp::full_tensor(item.value(), item.value().grad()), ref[item.key()].grad(),
                            item.key() + " grad");
    }
  }
}

// set_requires_gradient_sync(false): the backwards add the gathered gradients up without
// communication; the next synced backward reduce-scatters the sum: the gradient of all three
// microbatches.
TEST(FullyShard, GradientAccumulationWithoutSync) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  Net reference, net;
  auto root = fs::fully_shard(net, fs::FullyShardOptions().mesh(dp_mesh()));
  for (int64_t m = 0; m < 3; ++m) {
    loss_of(reference.forward(batch(m, p))).backward();
    root.set_requires_gradient_sync(m == 2);
    hp::comm::reset_collective_counts();
    loss_of(net.forward(batch(m, p).narrow(0, r * kRowsPerRank, kRowsPerRank))).backward();
    EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kReduceScatter), m == 2 && p > 1 ? 1 : 0)
        << "microbatch " << m;
  }
  const auto ref = reference.parameters();
  const auto grads = hp::tensor_parallel::full_named_parameters(net, /*gradients=*/true);
  ASSERT_EQ(grads.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i)
    hp_test::expect_close(grads[i].second, ref[i].grad(), grads[i].first);
}

// apply_grad_on_fp32_main_grad: bf16 shards reduced in fp32 get their gradient in main_grad, in
// fp32 and summed over two backwards (the reference's two backwards, each rank's rows computed in
// bf16 as the group does), .grad untouched; zero_grad clears it.
TEST(FullyShard, MainGradKeepsTheReducedDtypeAndSumsTheBackwards) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  Net reference, net;
  reference.to(at::kBFloat16);
  net.to(at::kBFloat16);
  auto root = fs::fully_shard(
      net, fs::FullyShardOptions().mesh(dp_mesh()).mp_policy(
               fs::MixedPrecisionPolicy().reduce_dtype(at::kFloat).apply_grad_on_fp32_main_grad(true)));
  std::map<std::string, at::Tensor> expected;
  for (int64_t m = 0; m < 2; ++m) {
    for (int64_t k = 0; k < p; ++k) {  // rank k's rows, averaged over the ranks in fp32
      reference.zero_grad();
      loss_of(reference.forward(batch(m, p).narrow(0, k * kRowsPerRank, kRowsPerRank).to(at::kBFloat16)))
          .backward();
      for (const auto& item : reference.named_parameters()) {
        const auto part = item.value().grad().to(at::kFloat) / static_cast<double>(p);
        auto& sum = expected[item.key()];
        sum = sum.defined() ? sum + part : part;
      }
    }
    loss_of(net.forward(batch(m, p).narrow(0, r * kRowsPerRank, kRowsPerRank).to(at::kBFloat16))).backward();
  }
  bool finer_than_bf16 = false;
  for (const auto& item : net.named_parameters()) {
    const auto main = hp::nn::main_grad(item.value());
    ASSERT_TRUE(main.defined()) << item.key();
    EXPECT_EQ(main.scalar_type(), at::kFloat) << item.key();
    EXPECT_FALSE(item.value().grad().defined()) << item.key();
    hp_test::expect_close(hp::tensor_parallel::full_tensor(item.value(), main), expected[item.key()],
                          item.key() + " main_grad");
    finer_than_bf16 = finer_than_bf16 || !at::equal(main, main.to(at::kBFloat16).to(at::kFloat));
  }
  EXPECT_TRUE(finer_than_bf16 || p == 1);
  root.zero_grad();
  for (const auto& param : net.parameters()) EXPECT_FALSE(hp::nn::main_grad(param).defined());
}

// set_reshard_after_backward(false) beside set_requires_gradient_sync(false), reshard_after_forward
// false: three microbatches gather each group once (the next forward finds it gathered), with the
// same gradients.
TEST(FullyShard, ReshardAfterBackwardFalseGathersOnceForTheMicrobatches) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  Net reference, net;
  const auto options = fs::FullyShardOptions().mesh(dp_mesh()).reshard_after_forward(false);
  for (auto& b : net.blocks) fs::fully_shard(*b, options);
  auto root = fs::fully_shard(net, options);
  hp::comm::reset_collective_counts();
  for (int64_t m = 0; m < 3; ++m) {
    loss_of(reference.forward(batch(m, p))).backward();
    root.set_requires_gradient_sync(m == 2);
    root.set_reshard_after_backward(m == 2);
    loss_of(net.forward(batch(m, p).narrow(0, r * kRowsPerRank, kRowsPerRank))).backward();
  }
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllGather), p > 1 ? kBlocks + 1 : 0);
  const auto ref = reference.parameters();
  const auto grads = hp::tensor_parallel::full_named_parameters(net, /*gradients=*/true);
  ASSERT_EQ(grads.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i)
    hp_test::expect_close(grads[i].second, ref[i].grad(), grads[i].first);
}

// param_dtype bfloat16 (gathered and computed in it), reduce_dtype float32: the float32 shards
// train close to the float32 reference; their gradients stay float32.
TEST(FullyShard, MixedPrecisionGathersInParamDtypeAndReducesInReduceDtype) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  Net reference, net;
  shard(net, fs::FullyShardOptions().mesh(dp_mesh()).mp_policy(
                 fs::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat)));
  const auto ref_losses = train(reference, 2, r, p, false);
  const auto losses = train(net, 2, r, p, true);
  for (size_t s = 0; s < losses.size(); ++s)
    EXPECT_NEAR(losses[s], ref_losses[s], 3e-2 * std::abs(ref_losses[s]));
  for (const auto& param : net.parameters()) {
    EXPECT_EQ(param.scalar_type(), at::kFloat);
    EXPECT_EQ(param.grad().scalar_type(), at::kFloat);
  }
}

// A language model's embedding in a group of its own: the step's tokens touch few of its rows.
struct Lm : torch::nn::Module {
  static constexpr int64_t kVocab = 96;
  Lm() {
    at::manual_seed(11);
    embed = register_module("embed", hp::nn::Embedding(kVocab, kIn));
    block = register_module("block", std::make_shared<Block>());
    head = register_module("head", hp::nn::Linear(kIn, kVocab));
  }
  at::Tensor forward(const at::Tensor& ids) { return head(block->forward(embed(ids))); }
  hp::nn::Embedding embed{nullptr};
  std::shared_ptr<Block> block;
  hp::nn::Linear head{nullptr};
};

// Rank r's ids of step `step`: 2 x 5 tokens among 8 of the vocabulary, a set that moves with the
// rank and the step (rows some ranks share, rows only one rank has).
at::Tensor token_ids(int64_t step, int64_t rank) {
  at::manual_seed(200 + step * 16 + rank);
  return at::randint(0, 8, {2, 5}, at::kLong) * 11 % Lm::kVocab + rank;
}

struct LmRun {
  std::vector<double> losses;
  std::vector<at::Tensor> params;
  int64_t forward_bytes = 0, backward_bytes = 0, reduce_scatters = 0;
  fs::GatherStats embedding_gathers;
};

// With `tp`, the embedding is first cut by vocabulary rows over it (RowwiseParallel), and
// `replica` is this rank's data-parallel index (the ranks of one replica read the same ids).
LmRun train_lm(const fs::FullyShardOptions& options, int64_t steps,
               const std::optional<DeviceMesh>& tp = std::nullopt, int64_t replica = hp_test::rank()) {
  const int64_t r = replica;
  Lm lm;
  if (tp) {
    hp::tensor_parallel::parallelize_module(
        *lm.embed, *tp,
        hp::tensor_parallel::RowwiseParallel(
            hp::tensor_parallel::RowwiseParallelOptions().input_layouts(hp::dtensor::Replicate())));
  }
  fs::fully_shard(*lm.embed, options);
  fs::fully_shard(*lm.block, options);
  fs::fully_shard(lm, options);
  torch::optim::AdamW opt(lm.parameters(), torch::optim::AdamWOptions(1e-2));
  LmRun run;
  hp::comm::reset_collective_counts();
  for (int64_t s = 0; s < steps; ++s) {
    opt.zero_grad();
    const int64_t at_start = hp::comm::payload_bytes_sent();
    auto loss = lm.forward(token_ids(s, r)).pow(2).mean();
    run.forward_bytes += hp::comm::payload_bytes_sent() - at_start;
    {
      hp::comm::CommRegion region("backward");
      const int64_t before = hp::comm::payload_bytes_sent();
      loss.backward();
      run.backward_bytes += hp::comm::payload_bytes_sent() - before;
    }
    opt.step();
    run.losses.push_back(loss.item<double>());
  }
  run.reduce_scatters = hp::comm::collective_count(CollectiveKind::kReduceScatter, "backward");
  run.embedding_gathers = fs::FSDPModule::of(*lm.embed)->group()->gather_stats();
  for (const auto& p : lm.parameters()) run.params.push_back(hp::tensor_parallel::full_tensor(p));
  return run;
}

// The embedding's forward gathers only the rows of its tokens, its backward gathers nothing, and
// its reduce-scatter sends only the rows of the tokens some rank saw; training gives the dense
// run's bits: losses and every parameter, kept or resharded after the forward, fp32 and with
// bf16 parameters reduced in fp32.
TEST(FullyShard, AnEmbeddingAloneGathersAndReducesRowSparseBitwiseAsDense) {
  const int64_t p = hp_test::world_size();
  for (bool reshard : {true, false}) {
    for (bool mixed : {false, true}) {
      SCOPED_TRACE(std::string(reshard ? "resharded" : "kept") + (mixed ? ", bf16 params" : ", fp32"));
      auto options = fs::FullyShardOptions().mesh(dp_mesh()).reshard_after_forward(reshard);
      if (mixed)
        options.mp_policy(fs::MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
      const auto dense = train_lm(fs::FullyShardOptions(options).row_sparse_embeddings(false), 3);
      const auto sparse = train_lm(options, 3);
      EXPECT_EQ(sparse.losses, dense.losses);
      ASSERT_EQ(sparse.params.size(), dense.params.size());
      for (size_t i = 0; i < dense.params.size(); ++i)
        EXPECT_TRUE(sparse.params[i].equal(dense.params[i])) << "parameter " << i;
      EXPECT_EQ(sparse.reduce_scatters, dense.reduce_scatters);
      if (p > 1) {
        // Per step, the embedding's dense reduce-scatter sends (P - 1) of its P blocks of
        // ceil(96 / P) fp32 rows of 12; the sparse one its P counts to each peer and at most the
        // 10 rows this rank's tokens touched (an index and a row each).
        const int64_t row_bytes = kIn * 4, block_rows = (Lm::kVocab + p - 1) / p;
        const int64_t dense_embedding = (p - 1) * block_rows * row_bytes;
        const int64_t sparse_embedding = (p - 1) * 8 * p + 10 * (8 + row_bytes);
        EXPECT_LE(sparse.backward_bytes, dense.backward_bytes - 3 * (dense_embedding - sparse_embedding));
        // The forward: the dense gather sends this rank's block of ceil(96 / P) rows to each
        // peer; the sparse one a count to each peer, at most 10 offsets, and at most the 10 rows
        // each peer asks for.
        const int64_t gathered_row = kIn * (mixed ? 2 : 4);
        const int64_t dense_gather = (p - 1) * block_rows * gathered_row;
        const int64_t sparse_gather = (p - 1) * 8 + 10 * 8 + (p - 1) * 10 * gathered_row;
        EXPECT_LE(sparse.forward_bytes, dense.forward_bytes - 3 * (dense_gather - sparse_gather));
      }
      // One gather per forward; the dense run's resharded embedding is gathered again in each
      // backward, the sparse one's is not (its backward reads no weight).
      EXPECT_EQ(sparse.embedding_gathers.gathers, 3);
      EXPECT_EQ(dense.embedding_gathers.gathers, reshard ? 6 : 3);
    }
  }
}

// Two embeddings of one shape, each a row-sparse group, that rank 0 runs in the other order after
// the first step: its row gathers and gradient reduce-scatters would meet the other table's on the
// other ranks. An error on every rank instead, naming the contents, before any row moves.
TEST(FullyShard, TwoEmbeddingsOfOneShapeRunInDifferentOrdersByRankAreAnError) {
  if (hp_test::world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  struct TwoTables : torch::nn::Module {
    TwoTables() {
      a = register_module("a", hp::nn::Embedding(Lm::kVocab, kIn));
      b = register_module("b", hp::nn::Embedding(Lm::kVocab, kIn));
    }
    hp::nn::Embedding a{nullptr}, b{nullptr};
  };
  TwoTables net;
  const auto options = fs::FullyShardOptions().mesh(dp_mesh());
  fs::fully_shard(*net.a, options);
  fs::fully_shard(*net.b, options);
  fs::fully_shard(net, options);
  std::string message;
  try {
    for (int64_t step = 0; step < 2; ++step) {
      const auto ids = token_ids(step, hp_test::rank());
      const bool a_first = step == 0 || hp_test::rank() != 0;
      auto first = a_first ? net.a(ids) : net.b(ids);
      auto second = a_first ? net.b(ids) : net.a(ids);
      (first * second).sum().backward();
    }
  } catch (const c10::Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("disagree on all_gather"), std::string::npos) << message;
  EXPECT_NE(message.find(" content="), std::string::npos) << message;
}

// An embedding whose vocabulary rows a TP style cut over tp 2 maps its ids to its own rows, so
// fully_shard over dp 2 gathers its table whole (asking for rows by id would ask for rows past
// its half) and still reduces its gradient row-sparse: the dense run's bits.
TEST(FullyShard, AnEmbeddingCutByVocabularyUnderTPGathersWholeAndTrainsAsDense) {
  if (hp_test::world_size() != 4) GTEST_SKIP() << "a 2 x 2 (dp, tp) mesh needs 4 ranks";
  auto mesh = hp::dtensor::init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
  const auto options = fs::FullyShardOptions().mesh(mesh["dp"]);
  const int64_t replica = mesh.get_local_rank(0);
  const auto dense =
      train_lm(fs::FullyShardOptions(options).row_sparse_embeddings(false), 3, mesh["tp"], replica);
  const auto sparse = train_lm(options, 3, mesh["tp"], replica);
  EXPECT_EQ(sparse.losses, dense.losses);
  for (size_t i = 0; i < dense.params.size(); ++i)
    EXPECT_TRUE(sparse.params[i].equal(dense.params[i])) << "parameter " << i;
  EXPECT_LT(sparse.backward_bytes, dense.backward_bytes);
  EXPECT_EQ(sparse.forward_bytes, dense.forward_bytes) << "the whole table is gathered in both";
}

// A module no shared_ptr owns, managed through nested calls alone (its own state holds no
// parameter), is gone when destroyed: another made at its address is a new module, which
// fully_shard takes and trains (while the first lives, a second call on it is an error).
TEST(FullyShard, AModuleMadeWhereAGoneOneWasIsANewOne) {
  struct Pair : torch::nn::Module {
    Pair() {
      a = register_module("a", hp::nn::Linear(kIn, kIn));
      b = register_module("b", hp::nn::Linear(kIn, kIn));
    }
    hp::nn::Linear a{nullptr}, b{nullptr};
  };
  const auto options = fs::FullyShardOptions().mesh(dp_mesh());
  alignas(Pair) unsigned char storage[sizeof(Pair)];
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    auto* pair = new (storage) Pair();
    fs::fully_shard(*pair->a, options);
    fs::fully_shard(*pair->b, options);
    EXPECT_NO_THROW(fs::fully_shard(*pair, options));
    EXPECT_TRUE(fs::FSDPModule::of(*pair).has_value());
    HP_EXPECT_THROW_MSG(fs::fully_shard(*pair, options),
                        "fully_shard: expected a module fully_shard was not applied to");
    loss_of(pair->b(pair->a(batch(round, 1).narrow(0, 0, kRowsPerRank)))).backward();
    EXPECT_TRUE(pair->a->weight.grad().defined());
    pair->~Pair();
  }
}

// fully_shard on a list of modules: one group of their parameters, gathered once per pass (by
// the first of them to run) and reduce-scattered once, next to each other (norm, head: bitwise
// the run with them in the root's group) or with another group between them (block0, head).
TEST(FullyShard, AListOfModulesIsOneGroupGatheredOncePerPass) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  const int64_t moves = p > 1 ? 1 : 0;
  Net reference, in_root;
  train(reference, 3, r, p, /*sharded=*/false);
  const auto ref_params = full_parameters(reference);
  shard(in_root, fs::FullyShardOptions().mesh(dp_mesh()));
  train(in_root, 3, r, p, /*sharded=*/true);
  for (bool apart : {false, true}) {
    SCOPED_TRACE(apart ? "block0 and head" : "norm and head");
    Net net;
    const auto options = fs::FullyShardOptions().mesh(dp_mesh());
    fs::fully_shard(*net.blocks[1], options);
    if (!apart) fs::fully_shard(*net.blocks[0], options);
    torch::nn::Module* first = apart ? static_cast<torch::nn::Module*>(net.blocks[0].get()) : net.norm.get();
    const auto handles = fs::fully_shard({first, net.head.get()}, options);
    ASSERT_EQ(handles.size(), 2u);
    EXPECT_EQ(handles[0].group(), handles[1].group());
    EXPECT_EQ(fs::FSDPModule::of(*net.head)->group(), handles[0].group());
    auto root = fs::fully_shard(net, options);
    EXPECT_EQ(root.group() == nullptr, !apart);  // the norm's when apart
    hp::comm::reset_collective_counts();
    {
      hp::comm::CommRegion region("step");
      train(net, 3, r, p, /*sharded=*/true);
    }
    const int64_t groups = kBlocks + 1;
    // A step: each group gathers for its forward and again for its backward, and reduces once.
    EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllGather, "step"), 3 * 2 * moves * groups);
    EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kReduceScatter, "step"), 3 * moves * groups);
    const auto params = full_parameters(net);
    auto same = in_root.parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      hp_test::expect_close(params[i], ref_params[i], "parameter " + std::to_string(i));
      if (!apart) {
        EXPECT_TRUE(at::equal(net.parameters()[i], same[i])) << "parameter " << i << " not bitwise";
      }
    }
  }
}

// A module listed twice or below another of the list is a part of that one; an empty list, a
// nullptr and a managed module (by its index) are errors that change nothing.
TEST(FullyShard, AListsErrorsNameWhatWasExpected) {
  const auto options = fs::FullyShardOptions().mesh(dp_mesh());
  HP_EXPECT_THROW_MSG(fs::fully_shard(std::vector<torch::nn::Module*>{}, options),
                      "fully_shard: expected a non-empty list of modules, got an empty one");
  Net net;
  HP_EXPECT_THROW_MSG(fs::fully_shard({net.norm.get(), nullptr}, options),
                      "fully_shard: expected a module at index 1 of the list, got nullptr");
  fs::fully_shard(*net.head, options);
  HP_EXPECT_THROW_MSG(fs::fully_shard({net.norm.get(), net.head.get()}, options),
                      "fully_shard: expected a module fully_shard was not applied to, got "
                      "hyper_parallel::nn::LinearImpl at index 1 of the list again");
  EXPECT_FALSE(fs::FSDPModule::of(*net.norm).has_value());
  auto& block = *net.blocks[0];
  const auto handles = fs::fully_shard({block.up.get(), &block, &block}, options);
  ASSERT_EQ(handles.size(), 1u);
  EXPECT_TRUE(fs::FSDPModule::of(block).has_value());
  EXPECT_FALSE(fs::FSDPModule::of(*block.up).has_value());
  EXPECT_EQ(handles[0].group()->parameters().size(), 4u);
}

TEST(FullyShard, ErrorsNameWhatWasExpected) {
  HP_EXPECT_THROW_MSG(fs::ParamGroup({at::zeros({})}, {"scalar"}, {}),
                      "fully_shard: expected parameters of at least one dim (sharded on dim 0), got scalar");
  HP_EXPECT_THROW_MSG(
      fs::ParamGroup({at::zeros({2})}, {"w"},
                     fs::FullyShardOptions().offload_policy(fs::OffloadPolicy().pin_memory(true))),
      "expected OffloadPolicy pin_memory false");
  if (hp_test::world_size() == 4) {
    auto cube = hp::dtensor::init_device_mesh("cpu", {1, 2, 2}, {"a", "b", "c"});
    Net net;
    HP_EXPECT_THROW_MSG(
        fs::fully_shard(net, fs::FullyShardOptions().mesh(cube)),
        "fully_shard: expected a 1-d mesh (shard) or a 2-d mesh (replicate, shard) for HSDP, got a 3-d");
  }
  struct WithTorchLinear : torch::nn::Module {
    WithTorchLinear() { lin = register_module("lin", torch::nn::Linear(4, 4)); }
    torch::nn::Linear lin{nullptr};
  };
  auto plain = std::make_shared<WithTorchLinear>();
  HP_EXPECT_THROW_MSG(fs::fully_shard(*plain, fs::FullyShardOptions().mesh(dp_mesh())),
                      "fully_shard: expected every parameter to belong to a hyper_parallel::nn module");
  Net net;
  fs::fully_shard(*net.blocks[0], fs::FullyShardOptions().mesh(dp_mesh()));
  HP_EXPECT_THROW_MSG(fs::fully_shard(*net.blocks[0], fs::FullyShardOptions().mesh(dp_mesh())),
                      "fully_shard: expected a module fully_shard was not applied to");
  HP_EXPECT_THROW_MSG(fs::ParamGroup({net.blocks[0]->up->weight}, {"up.weight"}, {}),
                      "fully_shard: expected a parameter no fully_shard manages yet, got up.weight");
  // Styles come before fully_shard: a parameter it laid out takes no style afterwards. (24 rows
  // shard evenly at every world size, so the plan's shapes agree across ranks.)
  auto lin = hp::nn::Linear(12, 24);
  fs::fully_shard(*lin, fs::FullyShardOptions().mesh(dp_mesh()));
  auto tp_mesh = hp::dtensor::init_device_mesh("cpu", {hp_test::world_size()}, {"tp"});
  HP_EXPECT_THROW_MSG(
      hp::tensor_parallel::parallelize_module(*lin, tp_mesh, hp::tensor_parallel::ColwiseParallel()),
      "parameter 'weight' is already laid out (by another style, or by fully_shard: apply styles first)");
  fs::ParamGroup two({at::zeros({4, 2}), at::zeros({4, 2})}, {"a", "b"},
                     fs::FullyShardOptions().mesh(dp_mesh()));
  HP_EXPECT_THROW_MSG(
      two.set_row_sparse_gradients(true),
      "ParamGroup::set_row_sparse_gradients: expected a group of one parameter of at least 2 dims "
      "(an embedding's weight), got 2 parameters, the first of shape [4, 2]");
  fs::ParamGroup vector({at::zeros({4})}, {"v"}, fs::FullyShardOptions().mesh(dp_mesh()));
  HP_EXPECT_THROW_MSG(vector.set_row_sparse_gradients(true), "got 1 parameters, the first of shape [4]");
  // adopt_parameter: a new tensor for a parameter (a conversion from meta, say).
  const auto piece = two.parameters()[0].sizes().vec();
  HP_EXPECT_THROW_MSG(two.adopt_parameter(2, at::zeros(piece)),
                      "ParamGroup::adopt_parameter: expected an index in [0, 2), got 2");
  HP_EXPECT_THROW_MSG(
      two.adopt_parameter(0, two.parameters()[1]),
      "fully_shard: expected a replaced by a tensor no fully_shard manages, got a managed one");
  two.unshard();
  HP_EXPECT_THROW_MSG(
      two.adopt_parameter(0, at::zeros(piece)),
      "fully_shard: expected a replaced while its group is resharded, got the group gathered");
  two.reshard();
  const auto adopted = at::ones(piece);
  two.adopt_parameter(0, adopted);
  EXPECT_TRUE(two.parameters()[0].is_same(adopted) && fs::ParamGroup::is_managed(adopted));
  // Its shape is checked by the next gather, on every rank (a rank's piece may be empty).
  two.adopt_parameter(1, at::zeros({5, 2}));
  HP_EXPECT_THROW_MSG(two.unshard(), "fully_shard: expected b to stay this rank's piece of it (shape [");
  // A collective on meta (no data) is an error, not a transfer from no memory.
  HP_EXPECT_THROW_MSG(hp::comm::broadcast(at::zeros({2}, at::kMeta), 0, hp::comm::world()),
                      "hyper_parallel::comm::broadcast: expected a tensor with data, got one on meta");
}

}  // namespace
