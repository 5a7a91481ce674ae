// Data parallelism: gradients averaged over the mesh's dp dimension by bucketed all-reduces that
// run during the backward. DP alone (every world size) and DP 2 x TP 2 (4 ranks) train equal to
// the single-process model over the global batch; runs are bitwise deterministic and the
// overlapped path equals the blocking one bitwise; unused, partly used and shared parameters and
// gradient accumulation give the right sums; ranks that lay out different buckets get an error.
#include <gtest/gtest.h>

#include <functional>
#include <stdexcept>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/sgd.h>

#include <hyper_parallel/hyper_parallel.h>

#include "common/test_util.h"

namespace hp = hyper_parallel;
namespace dp = hp::data_parallel;
namespace tp = hp::tensor_parallel;
using hp::dtensor::DeviceMesh;
using hp::dtensor::init_device_mesh;

namespace {

constexpr int64_t kDim = 16, kHidden = 32, kGlobalBatch = 12;

// fc2(relu(fc1(x))) + tied(tied(x)), plus `partial` on the ranks told to use it, and `spare`,
// which no rank uses.
struct Net : torch::nn::Module {
  explicit Net(uint64_t seed) {
    at::manual_seed(seed);
    fc1 = register_module("fc1", hp::nn::Linear(kDim, kHidden));
    fc2 = register_module("fc2", hp::nn::Linear(kHidden, kDim));
    tied = register_module("tied", hp::nn::Linear(kDim, kDim));
    partial = register_module("partial", hp::nn::Linear(kDim, kDim));
    spare = register_module("spare", hp::nn::Linear(kDim, kDim));
  }
  at::Tensor forward(const at::Tensor& x, bool use_partial = false) {
    auto y = fc2(at::relu(fc1(x))) + tied(tied(x));
    return use_partial ? y + partial(x) : y;
  }
  hp::nn::Linear fc1{nullptr}, fc2{nullptr}, tied{nullptr}, partial{nullptr}, spare{nullptr};
};

// Micro-batch `micro` of step `step`: the global batch's inputs and targets.
std::pair<at::Tensor, at::Tensor> global_batch(int64_t step, int64_t micro = 0) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * step + micro + 1);
  return {at::randn({kGlobalBatch, kDim}, gen), at::randn({kGlobalBatch, kDim}, gen)};
}

// Replica `replica` of `replicas` takes its rows of the global batch; the loss is its mean, so
// the replicas' average gradient is the global batch's.
at::Tensor loss_of(Net& net, int64_t step, int64_t replica, int64_t replicas, bool use_partial = false,
                   int64_t micro = 0) {
  auto [x, target] = global_batch(step, micro);
  const int64_t rows = kGlobalBatch / replicas;
  x = x.narrow(0, replica * rows, rows);
  target = target.narrow(0, replica * rows, rows);
  return (net.forward(x, use_partial) - target).pow(2).mean();
}

std::vector<at::Tensor> train(Net& net, int64_t steps, int64_t replica, int64_t replicas) {
  torch::optim::SGD sgd(net.parameters(), torch::optim::SGDOptions(0.1));
  for (int64_t step = 0; step < steps; ++step) {
    sgd.zero_grad();
    loss_of(net, step, replica, replicas).backward();
    sgd.step();
  }
  std::vector<at::Tensor> out;
  for (const auto& p : net.parameters()) out.push_back(p.detach().clone());
  return out;
}

DeviceMesh dp_mesh() { return init_device_mesh("cpu", {hp_test::world_size()}, {"dp"}); }
dp::GradientReducerOptions small_buckets() { return dp::GradientReducerOptions().bucket_cap_bytes(1024); }

std::vector<at::Tensor> train_data_parallel(dp::GradientReducerOptions options, int64_t steps = 3) {
  Net net(7);
  auto mesh = dp_mesh();
  auto reducer = dp::data_parallel(net, mesh, options);
  return train(net, steps, mesh.get_local_rank(0), mesh.size(0));
}

void expect_bitwise_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b,
                          const char* what) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << what << ": parameter " << i;
}

TEST(DataParallel, TrainsEqualToTheSingleProcessModelOverTheGlobalBatch) {
  auto params = train_data_parallel(small_buckets());
  Net ref(7);
  auto expected = train(ref, 3, 0, 1);
  ASSERT_EQ(params.size(), expected.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(at::allclose(params[i], expected[i], 1e-5, 1e-6))
        << "parameter " << i << ": max abs diff " << (params[i] - expected[i]).abs().max().item<double>();
  }
  // The replicas hold bitwise the same parameters.
  for (const auto& p : params) {
    auto all = hp::comm::all_gather(p.reshape({1, -1}), 0, hp::comm::world());
    for (int64_t q = 1; q < all.size(0); ++q) EXPECT_TRUE(at::equal(all[q], all[0])) << "rank " << q;
  }
}

TEST(DataParallel, IsBitwiseDeterministicAndOverlapEqualsBlockingBitwise) {
  auto first = train_data_parallel(small_buckets());
  auto second = train_data_parallel(small_buckets());
  auto blocking = train_data_parallel(small_buckets().overlap(false));
  expect_bitwise_equal(first, second, "run to run");
  expect_bitwise_equal(first, blocking, "overlapped vs blocking");
}

TEST(DataParallel, StartsOneAllReducePerBucketInEachBackward) {
  Net net(7);
  auto mesh = dp_mesh();
  auto reducer = dp::data_parallel(net, mesh, small_buckets());
  const auto buckets = reducer->bucket_parameters();
  // 10 parameters in reverse order; fc2's weight (2 KiB) and fc1's (2 KiB) exceed 1 KiB alone.
  EXPECT_EQ(reducer->parameters().size(), 10u);
  EXPECT_EQ(buckets.front().front(), 9);
  EXPECT_GT(buckets.size(), 3u);
  for (int pass = 0; pass < 2; ++pass) {
    hp::comm::reset_collective_counts();
    loss_of(net, pass, mesh.get_local_rank(0), mesh.size(0)).backward();
    EXPECT_EQ(hp::comm::collective_count(hp::comm::CollectiveKind::kAllReduce),
              static_cast<int64_t>(buckets.size()));
  }
}

// Buckets start during the backward, not all at its end: by the time the input's gradient is
// computed (the backward's last step), the 4 buckets of the parameters this backward does not
// reach (`partial`, `spare`: 1 KiB buckets hold a weight or a bias) and at least one bucket of a
// layer it has been through have started.
TEST(DataParallel, StartsBucketsBeforeTheBackwardEnds) {
  Net net(7);
  auto mesh = dp_mesh();
  auto reducer = dp::data_parallel(net, mesh, small_buckets());
  auto [x, target] = global_batch(0);
  x.requires_grad_(true);
  int64_t started_before_input_grad = -1;
  x.register_hook([&](const at::Tensor&) {
    started_before_input_grad = hp::comm::collective_count(hp::comm::CollectiveKind::kAllReduce);
  });
  hp::comm::reset_collective_counts();
  (net.forward(x) - target).pow(2).mean().backward();
  const auto buckets = static_cast<int64_t>(reducer->bucket_parameters().size());
  EXPECT_GE(started_before_input_grad, 5);
  EXPECT_LT(started_before_input_grad, buckets);
  EXPECT_EQ(hp::comm::collective_count(hp::comm::CollectiveKind::kAllReduce), buckets);
}

// The first bucket has a cap of its own (DDP's 1 MiB by default), so the link starts early.
TEST(DataParallel, TheFirstBucketHasItsOwnCap) {
  Net net(7);
  auto reducer = dp::data_parallel(net, dp_mesh(), dp::GradientReducerOptions().first_bucket_cap_bytes(64));
  const auto buckets = reducer->bucket_parameters();
  ASSERT_EQ(buckets.size(), 2u);  // spare's bias (64 bytes) alone; the other 9 in one 25 MiB bucket
  EXPECT_EQ(buckets[0], std::vector<int64_t>{9});
  EXPECT_EQ(buckets[1].size(), 9u);
}

// The average over the ranks of each rank's own gradients, from plain copies of the model.
std::vector<at::Tensor> expected_average(const std::function<void(Net&, int64_t q)>& backward_of) {
  const int64_t p = hp_test::world_size();
  std::vector<at::Tensor> sum;
  for (int64_t q = 0; q < p; ++q) {
    Net copy(7);
    backward_of(copy, q);
    auto params = copy.parameters();
    sum.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      if (!params[i].grad().defined()) continue;
      sum[i] = sum[i].defined() ? sum[i] + params[i].grad() : params[i].grad().clone();
    }
  }
  for (auto& s : sum) {
    if (s.defined()) s = s / double(p);
  }
  return sum;
}

void expect_gradients(Net& net, const std::vector<at::Tensor>& expected) {
  auto params = net.parameters();
  ASSERT_EQ(params.size(), expected.size());
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_EQ(params[i].grad().defined(), expected[i].defined()) << "parameter " << i;
    if (expected[i].defined())
      hp_test::expect_close(params[i].grad(), expected[i], "parameter " + std::to_string(i));
  }
}

TEST(DataParallel, UnusedPartlyUsedAndSharedParametersGetTheAverage) {
  // `partial` is used by rank 0 only: every rank gets rank 0's gradient / P. `spare` is used by
  // no rank: its .grad stays undefined. `tied` is applied twice: its two contributions are summed.
  auto mesh = dp_mesh();
  const int64_t p = mesh.size(0), r = mesh.get_local_rank(0);
  Net net(7);
  auto reducer = dp::data_parallel(net, mesh, small_buckets());
  loss_of(net, 0, r, p, /*use_partial=*/r == 0).backward();
  expect_gradients(
      net, expected_average([&](Net& copy, int64_t q) { loss_of(copy, 0, q, p, q == 0).backward(); }));
  EXPECT_FALSE(net.spare->weight.grad().defined());
}

TEST(DataParallel, AccumulatesTwoBackwardPassesWithAndWithoutNoSync) {
  auto mesh = dp_mesh();
  const int64_t p = mesh.size(0), r = mesh.get_local_rank(0);
  auto expected = expected_average([&](Net& copy, int64_t q) {
    loss_of(copy, 0, q, p, false, 0).backward();
    loss_of(copy, 0, q, p, false, 1).backward();
  });
  for (bool no_sync : {true, false}) {
    SCOPED_TRACE(no_sync ? "no_sync on the first pass" : "both passes reduced");
    Net net(7);
    auto reducer = dp::data_parallel(net, mesh, small_buckets());
    hp::comm::reset_collective_counts();
    {
      std::optional<dp::NoSyncGuard> guard;
      if (no_sync) guard.emplace(*reducer);
      loss_of(net, 0, r, p, false, 0).backward();
    }
    loss_of(net, 0, r, p, false, 1).backward();
    const auto buckets = static_cast<int64_t>(reducer->bucket_parameters().size());
    EXPECT_EQ(hp::comm::collective_count(hp::comm::CollectiveKind::kAllReduce),
              no_sync ? buckets : 2 * buckets);
    expect_gradients(net, expected);
  }
}

// A backward that fails part-way (after some buckets started) leaves the reducer ready for the
// next one, which averages as usual.
TEST(DataParallel, AFailedBackwardLeavesTheNextOneCorrect) {
  auto mesh = dp_mesh();
  const int64_t p = mesh.size(0), r = mesh.get_local_rank(0);
  Net net(7);
  auto reducer = dp::data_parallel(net, mesh, small_buckets());
  {
    auto [x, target] = global_batch(0);
    x.requires_grad_(true);
    x.register_hook([](const at::Tensor&) -> at::Tensor { throw std::runtime_error("failing on purpose"); });
    auto loss = (net.forward(x) - target).pow(2).mean();
    EXPECT_THROW(loss.backward(), std::exception);
  }
  for (auto& param : net.parameters()) param.mutable_grad() = at::Tensor();
  loss_of(net, 0, r, p).backward();
  expect_gradients(net, expected_average([&](Net& copy, int64_t q) { loss_of(copy, 0, q, p).backward(); }));
}

TEST(DataParallel, RanksWithDifferentBucketLayoutsGetAnErrorNotAHang) {
  if (hp_test::world_size() == 1) GTEST_SKIP() << "needs two ranks";
  Net net(7);
  auto mesh = dp_mesh();
  const int64_t cap = hp_test::rank() == 0 ? 1024 : 4096;
  HP_EXPECT_THROW_MSG((void)dp::data_parallel(net, mesh, dp::GradientReducerOptions().bucket_cap_bytes(cap)),
                      "GradientReducer: expected every rank of");
  // The group stays usable, and a matching layout works.
  auto reducer = dp::data_parallel(net, mesh, small_buckets());
  loss_of(net, 0, mesh.get_local_rank(0), mesh.size(0)).backward();
  EXPECT_TRUE(net.fc1->weight.grad().defined());
}

// A parameter resized after data_parallel (set_data) is refused with a message, not averaged
// over a stale layout.
TEST(DataParallel, ParametersChangedAfterwardsAreRefused) {
  auto mesh = dp_mesh();
  const int64_t p = mesh.size(0), r = mesh.get_local_rank(0);
  {
    Net net(7);
    auto reducer = dp::data_parallel(net, mesh, small_buckets());
    {
      at::NoGradGuard no_grad;
      net.spare->bias.set_data(at::zeros({kDim + 1}));
    }
    HP_EXPECT_THROW_MSG(loss_of(net, 0, r, p).backward(),
                        "GradientReducer::launch: expected parameter 9 to have the 16 elements laid out at "
                        "construction, got [17]");
  }
}

TEST(DataParallel, RejectsWhatItCannotUse) {
  Net net(7);
  HP_EXPECT_THROW_MSG(
      (void)dp::data_parallel(net, init_device_mesh("cpu", {1, hp_test::world_size()}, {"a", "b"})),
      "data_parallel: expected a 1-D mesh (the data-parallel dimension, e.g. mesh[\"dp\"]), got "
      "a 2-D mesh");
  HP_EXPECT_THROW_MSG(
      (void)dp::data_parallel(net, dp_mesh(), dp::GradientReducerOptions().bucket_cap_bytes(0)),
      "GradientReducer: expected bucket_cap_bytes > 0 and first_bucket_cap_bytes > 0, got 0 and "
      "1048576");
  HP_EXPECT_THROW_MSG(dp::GradientReducer(net.parameters(), hp::comm::Group()),
                      "GradientReducer: expected a group this rank is a member of, got a non-member");
  const auto leaf = at::ones({2}).requires_grad_(true);
  HP_EXPECT_THROW_MSG((void)dp::data_parallel({leaf, at::Tensor()}, dp_mesh()),
                      "GradientReducer: expected defined parameters, got an undefined one at index 1");
  HP_EXPECT_THROW_MSG((void)dp::data_parallel({leaf * 2}, dp_mesh()),
                      "GradientReducer: expected leaf parameters, got a non-leaf tensor at index 0");
  HP_EXPECT_THROW_MSG(
      (void)dp::data_parallel({at::ones({2}, at::kComplexFloat).requires_grad_(true)}, dp_mesh()),
      "GradientReducer: expected floating-point parameters, got ComplexFloat at index 0");
  // A sparse gradient (here set by hand on a parameter the backward does not reach).
  auto mesh = dp_mesh();
  auto reducer = dp::data_parallel(net, mesh, small_buckets());
  net.spare->bias.mutable_grad() = at::zeros({kDim}).to_sparse();
  HP_EXPECT_THROW_MSG(loss_of(net, 0, mesh.get_local_rank(0), mesh.size(0)).backward(),
                      "GradientReducer::launch: expected dense gradients, got a sparse one for parameter 9");
}

// DP 2 x TP 2: the TP plan on mesh["tp"], the reducer on mesh["dp"]; each dp replica runs half
// of the global batch. Sharded parameters equal the reference's slices after 3 SGD steps.
TEST(DataParallel, DataTimesTensorParallelTrainsEqualToTheSingleProcessModel) {
  if (hp_test::world_size() != 4) GTEST_SKIP() << "runs on 4 ranks (2 x 2 mesh)";
  auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
  auto dp_dim = mesh["dp"], tp_dim = mesh["tp"];
  auto run = [&](bool overlap) {
    Net net(7);
    tp::parallelize_module(*net.fc1, tp_dim, tp::ColwiseParallel());
    tp::parallelize_module(*net.fc2, tp_dim, tp::RowwiseParallel());
    auto reducer = dp::data_parallel(net, dp_dim, small_buckets().overlap(overlap));
    return train(net, 3, dp_dim.get_local_rank(0), 2);
  };
  auto params = run(true);
  expect_bitwise_equal(params, run(true), "run to run");
  expect_bitwise_equal(params, run(false), "overlapped vs blocking");
  Net ref(7);
  auto expected = train(ref, 3, 0, 1);
  const int64_t t = tp_dim.get_local_rank(0), h = kHidden / 2;
  // Parameter order: fc1 weight, bias; fc2 weight, bias; tied, partial, spare.
  std::vector<at::Tensor> slices = {expected[0].narrow(0, t * h, h), expected[1].narrow(0, t * h, h),
                                    expected[2].narrow(1, t * h, h), expected[3]};
  for (size_t i = 4; i < expected.size(); ++i) slices.push_back(expected[i]);
  ASSERT_EQ(params.size(), slices.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(at::allclose(params[i], slices[i], 1e-5, 1e-6))
        << "parameter " << i << ": max abs diff " << (params[i] - slices[i]).abs().max().item<double>();
  }
}

}  // namespace
