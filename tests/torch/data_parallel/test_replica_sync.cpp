// ReplicaSync: every rank gets group rank 0's states (DDP's broadcast when it wraps a module), of
// every dtype and size (0-dim, empty, bool beside wider dtypes in one bucket, non-contiguous), in
// one broadcast per bucket; data_parallel(module) starts replicas seeded apart from rank 0's; a
// replica whose states differ is an error on every rank, naming the state.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/sgd.h>

#include <hyper_parallel/hyper_parallel.h>

#include "common/test_util.h"

namespace hp = hyper_parallel;
namespace dp = hp::data_parallel;
using hp::comm::CollectiveKind;

namespace {

hp::dtensor::DeviceMesh dp_mesh() {
  return hp::dtensor::init_device_mesh("cpu", {hp_test::world_size()}, {"dp"});
}

// The states as rank `rank` holds them before the sync: values of its own.
std::vector<at::Tensor> states_of(int64_t rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11 + rank);
  return {at::randn({4, 3}, gen).t(),  // non-contiguous
          at::rand({7}, gen) > 0.5,    // bool: the next state starts at an odd byte of its bucket
          at::randn({5}, gen).to(at::kBFloat16),
          at::randn({3}, gen).to(at::kDouble),
          at::tensor(rank + 40),  // 0-dim int64
          at::empty({0, 2}),
          at::randint(0, 100, {2, 2}, gen).to(at::kInt)};
}

struct Seeded : torch::nn::Module {
  explicit Seeded(uint64_t seed) {
    at::manual_seed(seed);
    fc1 = register_module("fc1", hp::nn::Linear(8, 16));
    fc2 = register_module("fc2", hp::nn::Linear(16, 8));
    scale = register_buffer("scale", at::rand({8}));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(at::relu(fc1(x))) * scale; }
  hp::nn::Linear fc1{nullptr}, fc2{nullptr};
  at::Tensor scale;
};

std::vector<at::Tensor> train(Seeded& net, int64_t replica, int64_t replicas) {
  torch::optim::SGD sgd(net.parameters(), torch::optim::SGDOptions(0.1));
  for (int64_t step = 0; step < 3; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(step + 1);
    const auto x = at::randn({12, 8}, gen), target = at::randn({12, 8}, gen);
    const int64_t rows = 12 / replicas;
    sgd.zero_grad();
    (net.forward(x.narrow(0, replica * rows, rows)) - target.narrow(0, replica * rows, rows))
        .pow(2)
        .mean()
        .backward();
    sgd.step();
  }
  std::vector<at::Tensor> out;
  for (const auto& p : net.parameters()) out.push_back(p.detach().clone());
  return out;
}

}  // namespace

TEST(ReplicaSync, GivesEveryRankRankZerosStatesOfEveryDtypeOneBroadcastPerBucket) {
  for (const int64_t cap : {int64_t{256} << 20, int64_t{32}}) {
    auto states = states_of(hp_test::rank());
    const auto expected = states_of(0);
    dp::ReplicaSync sync(states, dp_mesh(), {}, cap);
    hp::comm::reset_collective_counts();
    sync();
    const int64_t p = hp_test::world_size();
    // cap 32: [48 bytes] [bool 7, bf16 10] [double 24, int64 8, empty] [int32 16]
    EXPECT_EQ(sync.bucket_count(), p == 1 ? 0 : cap == 32 ? 4 : 1);
    EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kBroadcast), sync.bucket_count());
    for (size_t i = 0; i < states.size(); ++i) {
      EXPECT_TRUE(at::equal(states[i], expected[i])) << "state " << i << ", cap " << cap;
      EXPECT_EQ(states[i].strides(), expected[i].strides()) << "state " << i;
    }
  }
}

TEST(ReplicaSync, DataParallelStartsReplicasSeededApartFromRankZerosModel) {
  auto mesh = dp_mesh();
  Seeded net(7 + static_cast<uint64_t>(hp_test::rank())), ref(7);
  auto reducer = dp::data_parallel(net, mesh, dp::GradientReducerOptions().bucket_cap_bytes(256));
  EXPECT_TRUE(at::equal(net.scale, ref.scale));
  const auto got = train(net, mesh.get_local_rank(0), mesh.size(0));
  const auto want = train(ref, 0, 1);
  for (size_t i = 0; i < got.size(); ++i)
    hp_test::expect_close(got[i], want[i], "parameter " + std::to_string(i));
}

TEST(ReplicaSync, ReplicasWhoseStatesDifferAreAnErrorOnEveryRank) {
  auto mesh = dp_mesh();
  HP_EXPECT_THROW_MSG(dp::ReplicaSync({at::zeros({2})}, mesh, {"a", "b"}),
                      "data_parallel::ReplicaSync: expected a name per state (1), got 2");
  HP_EXPECT_THROW_MSG(
      dp::ReplicaSync({}, hp::dtensor::init_device_mesh("cpu", {1, hp_test::world_size()})),
      "data_parallel::ReplicaSync: expected a 1-D mesh (the data-parallel dimension), got a 2-D");
  if (hp_test::world_size() == 1) return;
  const bool last = hp_test::rank() == hp_test::world_size() - 1;
  HP_EXPECT_THROW_MSG(dp::ReplicaSync({at::zeros({3}), at::zeros({last ? 5 : 4})}, mesh, {"w", "steps"}),
                      "expected steps to be Float[4] as on rank 0, got Float[5] on rank " +
                          std::to_string(hp_test::world_size() - 1) +
                          " (the replicas must be the same model)");
  HP_EXPECT_THROW_MSG(
      dp::ReplicaSync(std::vector<at::Tensor>(last ? 2 : 1, at::zeros({1})), mesh),
      "expected every rank of the data-parallel group to hold as many states as rank 0 (1), got 2 on rank");
  // Still in step: a sync after the errors.
  auto states = states_of(hp_test::rank());
  dp::ReplicaSync(states, mesh)();
  EXPECT_TRUE(at::equal(states[0], states_of(0)[0]));
}
