// Data parallelism: gradients averaged over the mesh's dp dimension by bucketed all-reduces that
// run during the backward. DP alone (every world size) and DP 2 x TP 2 (4 ranks) train equal to
// the single-process model over the global batch; runs are bitwise deterministic and the
// overlapped path equals the blocking one bitwise; unused, partly used and shared parameters and
// gradient accumulation give the right sums; ranks that lay out different buckets get an error.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>
#include <functional>
#include <set>
#include <stdexcept>

#include <ATen/ATen.h>
#include <torch/autograd.h>
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
at::Tensor replica_loss(const std::function<at::Tensor(const at::Tensor&)>& forward, int64_t step,
                        int64_t replica, int64_t replicas, int64_t micro = 0) {
  auto [x, target] = global_batch(step, micro);
  const int64_t rows = kGlobalBatch / replicas;
  return (forward(x.narrow(0, replica * rows, rows)) - target.narrow(0, replica * rows, rows)).pow(2).mean();
}

at::Tensor loss_of(Net& net, int64_t step, int64_t replica, int64_t replicas, bool use_partial = false,
                   int64_t micro = 0) {
  return replica_loss([&](const at::Tensor& x) { return net.forward(x, use_partial); }, step, replica,
                      replicas, micro);
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
  for (int pass = 0; pass < 3; ++pass) {  // the buckets are rebuilt after the first
    const auto count = static_cast<int64_t>(reducer->bucket_parameters().size());
    hp::comm::reset_collective_counts();
    loss_of(net, pass, mesh.get_local_rank(0), mesh.size(0)).backward();
    EXPECT_EQ(hp::comm::collective_count(hp::comm::CollectiveKind::kAllReduce), count);
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
  const auto buckets = static_cast<int64_t>(reducer->bucket_parameters().size());  // rebuilt after
  hp::comm::reset_collective_counts();
  (net.forward(x) - target).pow(2).mean().backward();
  EXPECT_GE(started_before_input_grad, 5);
  EXPECT_LT(started_before_input_grad, buckets);
  EXPECT_EQ(hp::comm::collective_count(hp::comm::CollectiveKind::kAllReduce), buckets);
}

// The first bucket has a cap of its own (DDP's 1 MiB by default), so the link starts early.
TEST(DataParallel, TheFirstBucketHasItsOwnCap) {
  Net net(7);
  auto reducer = dp::data_parallel(
      net, dp_mesh(),
      dp::GradientReducerOptions().first_bucket_cap_bytes(64).grow_first_buckets(false).shrink_last_buckets(
          false));
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

// The last buckets shrink: a bucket holds no more bytes than the parameters before it (at least
// the first bucket's cap), so the one the backward's end waits for is small.
TEST(DataParallel, TheLastBucketsShrinkTowardTheBackwardsEnd) {
  Net net(7);  // fp32: fc1 2048 + 128 bytes, fc2 2048 + 64, then 1024 + 64 for tied, partial, spare
  auto mesh = dp_mesh();
  auto reducer = dp::data_parallel(
      net, mesh, dp::GradientReducerOptions().first_bucket_cap_bytes(64).grow_first_buckets(false));
  using Layout = std::vector<std::vector<int64_t>>;
  // spare's bias alone (the first cap); then up to fc2's bias, 3264 bytes with 4224 before them;
  // fc2's weight (2176 bytes before it), fc1's bias (2048) and fc1's weight (none: 64) alone.
  EXPECT_EQ(reducer->bucket_parameters(), (Layout{{9}, {8, 7, 6, 5, 4, 3}, {2}, {1}, {0}}));
  loss_of(net, 0, mesh.get_local_rank(0), mesh.size(0)).backward();
  const int64_t p = hp_test::world_size();
  expect_gradients(net, expected_average([&](Net& copy, int64_t q) { loss_of(copy, 0, q, p).backward(); }));
}

// The first buckets grow: a bucket holds no more bytes than the buckets before it together (at
// least the first bucket's cap), so on a slow link each fills while the ones before it still
// cross. With shrinking too (the default), the last ones then shrink from where they meet.
TEST(DataParallel, TheFirstBucketsGrowFromTheFirstCap) {
  using Layout = std::vector<std::vector<int64_t>>;
  auto mesh = dp_mesh();
  const int64_t p = hp_test::world_size();
  {
    Net net(7);
    auto reducer = dp::data_parallel(
        net, mesh, dp::GradientReducerOptions().first_bucket_cap_bytes(64).shrink_last_buckets(false));
    // 64 bytes (the first cap); spare's weight alone (1024 > 64 before it); then 1088 with 1088
    // before, 1152 with 2176 before, 2176 with 3328 before; fc1's weight would take that to 4224.
    EXPECT_EQ(reducer->bucket_parameters(), (Layout{{9}, {8}, {7, 6}, {5, 4, 3}, {2, 1}, {0}}));
    loss_of(net, 0, mesh.get_local_rank(0), mesh.size(0)).backward();
    expect_gradients(net, expected_average([&](Net& copy, int64_t q) { loss_of(copy, 0, q, p).backward(); }));
  }
  Net net(7);
  auto reducer = dp::data_parallel(net, mesh, dp::GradientReducerOptions().first_bucket_cap_bytes(64));
  // fc2's weight would take its bucket past the 2176 bytes before it; fc1's bias has 2048 after it.
  EXPECT_EQ(reducer->bucket_parameters(), (Layout{{9}, {8}, {7, 6}, {5, 4, 3}, {2}, {1}, {0}}));
}

// Gradients as views of the buckets: the same bits as copies, whether the optimizer zeroes .grad
// in place (torch::optim's zero_grad detach_()es it, which an autograd view would refuse), .grad
// is set to none, or two backward passes accumulate over no_sync; the reduced gradients of one
// bucket share its buffer, so the next backward accumulates into it in place.
TEST(DataParallel, GradientsAsBucketViewsGiveTheBitsOfCopies) {
  expect_bitwise_equal(train_data_parallel(small_buckets()),
                       train_data_parallel(small_buckets().gradient_as_bucket_view(true)), "copies vs views");
  auto mesh = dp_mesh();
  const int64_t r = mesh.get_local_rank(0), p = mesh.size(0);
  auto gradients_of = [&](Net& net) {
    std::vector<at::Tensor> out;
    for (const auto& param : net.parameters())
      out.push_back(param.grad().defined() ? param.grad().clone() : at::zeros({0}));
    return out;
  };
  auto passes = [&](bool as_view) {
    Net net(7);
    auto reducer =
        dp::data_parallel(net, mesh, dp::GradientReducerOptions().gradient_as_bucket_view(as_view));
    torch::optim::SGD sgd(net.parameters(), torch::optim::SGDOptions(0.1));
    loss_of(net, 0, r, p).backward();
    if (as_view) {  // one bucket (the 1 MiB first one): every reduced .grad is on its buffer
      EXPECT_EQ(reducer->bucket_parameters().size(), 1u);
      EXPECT_TRUE(net.fc1->weight.grad().is_alias_of(net.tied->bias.grad()));
      EXPECT_FALSE(net.spare->weight.grad().defined());
    }
    std::vector<std::vector<at::Tensor>> grads{gradients_of(net)};
    for (int64_t step = 1; step < 3; ++step) {  // the buckets were rebuilt after the first pass
      sgd.step();
      sgd.zero_grad();
      const void* before = net.fc2->weight.grad().data_ptr();
      loss_of(net, step, r, p).backward();
      if (as_view) {  // the rebuild moved the gradients into its buckets: still in place
        EXPECT_EQ(net.fc2->weight.grad().data_ptr(), before) << "step " << step;
      }
      grads.push_back(gradients_of(net));
    }
    for (auto& param : net.parameters()) param.mutable_grad() = at::Tensor();
    {
      dp::NoSyncGuard no_sync(*reducer);
      loss_of(net, 3, r, p).backward();
    }
    loss_of(net, 4, r, p).backward();
    grads.push_back(gradients_of(net));
    return grads;
  };
  const auto copies = passes(false), views = passes(true);
  for (size_t pass = 0; pass < copies.size(); ++pass) expect_bitwise_equal(copies[pass], views[pass], "pass");
}

// second(first(x)) with `second` registered first: reverse registration order puts `first`'s
// parameters, whose gradients the backward produces last, in the first bucket, which then holds
// the other back until the end. With swap, first(second(x)).
struct Reversed : torch::nn::Module {
  Reversed() {
    at::manual_seed(3);
    second = register_module("second", hp::nn::Linear(kDim, kDim));
    first = register_module("first", hp::nn::Linear(kDim, kDim));
  }
  at::Tensor forward(const at::Tensor& x, bool swap) { return swap ? first(second(x)) : second(first(x)); }
  hp::nn::Linear second{nullptr}, first{nullptr};
};

at::Tensor loss_of(Reversed& net, int64_t replica, int64_t replicas, bool swap) {
  return replica_loss([&](const at::Tensor& x) { return net.forward(x, swap); }, 0, replica, replicas);
}

// The buckets as sets of parameters, in launch order.
std::vector<std::set<int64_t>> bucket_sets(const dp::GradientReducer& reducer) {
  std::vector<std::set<int64_t>> out;
  for (const auto& bucket : reducer.bucket_parameters()) out.emplace_back(bucket.begin(), bucket.end());
  return out;
}

// After the first backward the buckets follow the order it produced the gradients in, rank 0's
// (the other ranks run first(second(x)), which orders them the other way), and the next passes
// still average right.
TEST(DataParallel, RebuildsTheBucketsInRankZerosBackwardOrder) {
  auto mesh = dp_mesh();
  const int64_t r = mesh.get_local_rank(0), p = mesh.size(0);
  using Sets = std::vector<std::set<int64_t>>;
  const auto caps = dp::GradientReducerOptions().bucket_cap_bytes(1088).first_bucket_cap_bytes(1088);
  Reversed net;  // second's weight and bias are parameters 0 and 1, first's 2 and 3: 1088 bytes each
  auto reducer = dp::data_parallel(net, mesh, caps);
  Reversed fixed;
  auto fixed_reducer =
      dp::data_parallel(fixed, mesh, dp::GradientReducerOptions(caps).rebuild_buckets(false));
  EXPECT_EQ(bucket_sets(*reducer), (Sets{{2, 3}, {0, 1}}));
  for (int pass = 0; pass < 2; ++pass) {
    loss_of(net, r, p, /*swap=*/r != 0).backward();
    loss_of(fixed, r, p, /*swap=*/r != 0).backward();
    EXPECT_EQ(bucket_sets(*reducer), (Sets{{0, 1}, {2, 3}})) << "pass " << pass;
    EXPECT_EQ(bucket_sets(*fixed_reducer), (Sets{{2, 3}, {0, 1}})) << "pass " << pass;
    std::vector<at::Tensor> sum(4);
    for (int64_t q = 0; q < p; ++q) {
      Reversed copy;
      loss_of(copy, q, p, q != 0).backward();
      for (size_t i = 0; i < 4; ++i) {
        const auto g = copy.parameters()[i].grad() * double(pass + 1);  // accumulated over the passes
        sum[i] = sum[i].defined() ? sum[i] + g : g;
      }
    }
    for (size_t i = 0; i < 4; ++i) {
      hp_test::expect_close(net.parameters()[i].grad(), sum[i] / double(p), "parameter " + std::to_string(i));
      EXPECT_TRUE(at::equal(net.parameters()[i].grad(), fixed.parameters()[i].grad())) << "parameter " << i;
    }
  }
}

// The identity, whose backward takes 1 s: compute the gradients after it wait for. The layout
// below holds while the rest of the backward (microseconds of compute) stays under a quarter of
// it: a 250 ms stall of the process under load still leaves it as it is.
struct SlowInBackward : torch::autograd::Function<SlowInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    return grads;
  }
};

// d(c(slow(b(a(x))))): d's and c's gradients are ready early in the backward, b's and a's
// together at its end.
struct Chain : torch::nn::Module {
  Chain() {
    at::manual_seed(5);
    a = register_module("a", hp::nn::Linear(kDim, kDim));
    b = register_module("b", hp::nn::Linear(kDim, kDim));
    c = register_module("c", hp::nn::Linear(kDim, kDim));
    d = register_module("d", hp::nn::Linear(kDim, kDim));
  }
  at::Tensor forward(const at::Tensor& x) { return d(c(SlowInBackward::apply(b(a(x))))); }
  hp::nn::Linear a{nullptr}, b{nullptr}, c{nullptr}, d{nullptr};
};

// Once rebuilt, the last buckets shrink by the time the backward has left, not by the bytes it
// has left. Parameters 0-7: a, b, c, d (weight 1024 bytes, bias 64). In time: d's and c's
// gradients come with nearly all of the backward left, so after the first bucket (64-byte cap:
// d's first gradient alone) they share one; b's and a's come with none left, so each is alone
// (the first bucket's cap). In bytes: b's bias and weight (1088 bytes after the bias) share one.
// The gradients are the same bits either way.
TEST(DataParallel, OnceRebuiltTheLastBucketsShrinkByTheTimeLeft) {
  auto mesh = dp_mesh();
  const int64_t r = mesh.get_local_rank(0), p = mesh.size(0);
  const auto options = dp::GradientReducerOptions().first_bucket_cap_bytes(64).grow_first_buckets(false);
  Chain timed, by_bytes;
  auto timed_reducer = dp::data_parallel(timed, mesh, options);
  auto bytes_reducer =
      dp::data_parallel(by_bytes, mesh, dp::GradientReducerOptions(options).rebuild_buckets(false));
  auto loss = [&](Chain& net) {
    return replica_loss([&](const at::Tensor& x) { return net.forward(x); }, 0, r, p);
  };
  for (int pass = 0; pass < 2; ++pass) {
    loss(timed).backward();
    loss(by_bytes).backward();
    for (size_t i = 0; i < 8; ++i)
      EXPECT_TRUE(at::equal(timed.parameters()[i].grad(), by_bytes.parameters()[i].grad()))
          << "parameter " << i;
  }
  using Sets = std::vector<std::set<int64_t>>;
  const auto timed_layout = bucket_sets(*timed_reducer);
  ASSERT_EQ(timed_layout.size(), 6u);
  EXPECT_EQ(timed_layout[0].size() + timed_layout[1].size(), 4u);  // d's and c's: 1 + 3
  EXPECT_TRUE(timed_layout[1].count(4) && timed_layout[1].count(5)) << "c's weight and bias together";
  for (size_t k = 2; k < 6; ++k) EXPECT_EQ(timed_layout[k].size(), 1u) << "bucket " << k;
  EXPECT_EQ(bucket_sets(*bytes_reducer), (Sets{{7}, {6, 5, 4}, {3, 2}, {1}, {0}}));
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
    auto buckets = [&] { return static_cast<int64_t>(reducer->bucket_parameters().size()); };
    hp::comm::reset_collective_counts();
    const int64_t first_layout = buckets();
    {
      std::optional<dp::NoSyncGuard> guard;
      if (no_sync) guard.emplace(*reducer);
      loss_of(net, 0, r, p, false, 0).backward();
    }
    const int64_t second_layout = buckets();  // rebuilt after the first pass that reduced
    loss_of(net, 0, r, p, false, 1).backward();
    EXPECT_EQ(hp::comm::collective_count(hp::comm::CollectiveKind::kAllReduce),
              no_sync ? first_layout : first_layout + second_layout);
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
  const auto first_layout = reducer->bucket_parameters();
  {
    auto [x, target] = global_batch(0);
    x.requires_grad_(true);
    x.register_hook([](const at::Tensor&) -> at::Tensor { throw std::runtime_error("failing on purpose"); });
    auto loss = (net.forward(x) - target).pow(2).mean();
    EXPECT_THROW(loss.backward(), std::exception);
  }
  // Rank 0's pass failed: no rank rebuilds from it, the next pass is timed afresh.
  EXPECT_EQ(reducer->bucket_parameters(), first_layout);
  for (auto& param : net.parameters()) param.mutable_grad() = at::Tensor();
  loss_of(net, 0, r, p).backward();
  expect_gradients(net, expected_average([&](Net& copy, int64_t q) { loss_of(copy, 0, q, p).backward(); }));
  EXPECT_NE(reducer->bucket_parameters(), first_layout);  // rebuilt from this one
}

// Parameters the first backward does not reach (partial, spare: 6 to 9) go last in the rebuilt
// layout, as DDP puts them: one a later pass does use would otherwise hold every bucket back.
TEST(DataParallel, TheRebuiltLayoutPutsTheParametersTheFirstBackwardMissedLast) {
  auto mesh = dp_mesh();
  const int64_t p = mesh.size(0), r = mesh.get_local_rank(0);
  Net net(7);
  auto reducer = dp::data_parallel(net, mesh, small_buckets());
  loss_of(net, 0, r, p).backward();
  std::vector<int64_t> order;
  for (const auto& bucket : reducer->bucket_parameters())
    order.insert(order.end(), bucket.begin(), bucket.end());
  ASSERT_EQ(order.size(), 10u);
  EXPECT_EQ(std::set<int64_t>(order.end() - 4, order.end()), (std::set<int64_t>{6, 7, 8, 9}));
  loss_of(net, 1, r, p, /*use_partial=*/true).backward();  // partial's gradient now arrives, averaged
  EXPECT_TRUE(net.partial->weight.grad().defined());
}

TEST(DataParallel, RanksWithDifferentBucketLayoutsGetAnErrorNotAHang) {
  if (hp_test::world_size() == 1) GTEST_SKIP() << "needs two ranks";
  Net net(7);
  auto mesh = dp_mesh();
  const int64_t cap = hp_test::rank() == 0 ? 1024 : 4096;
  HP_EXPECT_THROW_MSG((void)dp::data_parallel(net, mesh, dp::GradientReducerOptions().bucket_cap_bytes(cap)),
                      "GradientReducer: expected every rank of");
  // The same buckets, but only some ranks would rebuild them (and broadcast, alone) after the
  // first backward: refused at construction too.
  HP_EXPECT_THROW_MSG(
      (void)dp::data_parallel(net, mesh, small_buckets().rebuild_buckets(hp_test::rank() == 0)),
      "GradientReducer: expected every rank of");
  // The same first buckets, but the caps of a rebuilt layout differ (a rank that shrinks the
  // last buckets by the first backward's time would lay them out otherwise): refused too.
  HP_EXPECT_THROW_MSG(
      (void)dp::data_parallel(net, mesh, small_buckets().shrink_last_buckets(hp_test::rank() == 0)),
      "GradientReducer: expected every rank of");
  HP_EXPECT_THROW_MSG(
      (void)dp::data_parallel(net, mesh, small_buckets().grow_first_buckets(hp_test::rank() == 0)),
      "GradientReducer: expected every rank of");
  // The same first layout, but another first cap, which shapes the rebuilt one: refused.
  HP_EXPECT_THROW_MSG(
      (void)dp::data_parallel(net, mesh,
                              small_buckets().first_bucket_cap_bytes(hp_test::rank() == 0 ? 2048 : 4096)),
      "GradientReducer: expected every rank of");
  // Rank 0 alone reduces fc1's weight row-sparse (its own bucket, another protocol): refused.
  const auto row_sparse =
      hp_test::rank() == 0 ? std::vector<at::Tensor>{net.fc1->weight} : std::vector<at::Tensor>{};
  HP_EXPECT_THROW_MSG((void)dp::data_parallel(net, mesh, small_buckets().row_sparse_parameters(row_sparse)),
                      "GradientReducer: expected every rank of");
  // The group stays usable, and a matching layout works.
  auto reducer = dp::data_parallel(net, mesh, small_buckets());
  loss_of(net, 0, mesh.get_local_rank(0), mesh.size(0)).backward();
  EXPECT_TRUE(net.fc1->weight.grad().defined());
}

// A token embedding and a projection: each replica looks up a few tokens of its own, so most of
// the embedding gradient's rows are zero on every rank.
struct Embedder : torch::nn::Module {
  Embedder() {
    at::manual_seed(5);
    embed = register_module("embed", hp::nn::Embedding(64, kDim));
    out = register_module("out", hp::nn::Linear(kDim, kDim));
  }
  at::Tensor loss(int64_t step, int64_t replica) {
    auto ids = at::arange(3, at::kLong) * 11 + (step + 5 * replica) % 64;  // 3 tokens, wrapped
    return out(embed(ids.remainder(64))).pow(2).mean();
  }
  hp::nn::Embedding embed{nullptr};
  hp::nn::Linear out{nullptr};
};

// data_parallel(module) reduces an Embedding's gradient row-sparse: a bucket of its own, only
// the rows some rank has travel, and the gradients are bitwise those of the dense reduction (a
// reducer over the same parameters with no row-sparse ones), which average every replica's.
TEST(DataParallel, EmbeddingGradientsTravelRowSparseWithTheDenseBits) {
  auto mesh = dp_mesh();
  const int64_t r = mesh.get_local_rank(0), p = mesh.size(0);
  Embedder sparse, dense;
  auto sparse_reducer = dp::data_parallel(sparse, mesh);
  auto dense_reducer = dp::data_parallel(dense.parameters(), mesh);
  // The embedding's weight is parameter 0: alone in its bucket, the last (its gradient comes last).
  EXPECT_EQ(sparse_reducer->bucket_parameters().back(), std::vector<int64_t>{0});
  for (int64_t step = 0; step < 3; ++step) {
    for (auto* net : {&sparse, &dense}) {
      for (auto& param : net->parameters()) param.mutable_grad() = at::Tensor();
    }
    hp::comm::reset_collective_counts();
    sparse.loss(step, r).backward();
    const int64_t sparse_bytes = hp::comm::payload_bytes_sent();
    hp::comm::reset_collective_counts();
    dense.loss(step, r).backward();
    const int64_t dense_bytes = hp::comm::payload_bytes_sent();
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_TRUE(at::equal(sparse.parameters()[i].grad(), dense.parameters()[i].grad()))
          << "parameter " << i;
    }
    // 3 of 64 rows (+ counts and indices) instead of 2 (P - 1) / P of the 4 KiB embedding.
    if (p > 1) {
      EXPECT_LT(sparse_bytes, dense_bytes - (p - 1) * 3 * 1024 / p) << "step " << step;
    }
  }
  Embedder reference;
  at::Tensor sum = at::zeros_like(reference.embed->weight);
  for (int64_t q = 0; q < p; ++q) {
    reference.embed->weight.mutable_grad() = at::Tensor();
    reference.loss(2, q).backward();
    sum += reference.embed->weight.grad();
  }
  hp_test::expect_close(sparse.embed->weight.grad(), sum / double(p), "the embedding's average gradient");
}

TEST(DataParallel, RowSparseParametersMustBeAmongTheParameters) {
  Embedder net;
  auto stranger = at::zeros({4, 4}, at::TensorOptions().requires_grad(true));
  HP_EXPECT_THROW_MSG(
      (void)dp::data_parallel(net.parameters(), dp_mesh(),
                              dp::GradientReducerOptions().row_sparse_parameters({stranger})),
      "GradientReducer: expected row_sparse_parameters[0] to be one of the parameters it averages "
      "(defined, requiring grad), got another tensor of sizes [4, 4]");
}

// row_sparse_embeddings(false): data_parallel(module) leaves the embedding with the dense
// parameters (in one bucket with them here: all of them fit the first cap) and sends the dense
// reducer's bytes.
TEST(DataParallel, RowSparseEmbeddingsFalseLeavesThemDense) {
  auto mesh = dp_mesh();
  Embedder net, reference;
  auto reducer = dp::data_parallel(net, mesh, dp::GradientReducerOptions().row_sparse_embeddings(false));
  auto dense_reducer = dp::data_parallel(reference.parameters(), mesh);
  EXPECT_EQ(reducer->bucket_parameters(), dense_reducer->bucket_parameters());
  EXPECT_EQ(reducer->bucket_parameters().size(), 1u);
  hp::comm::reset_collective_counts();
  net.loss(0, mesh.get_local_rank(0)).backward();
  const int64_t bytes = hp::comm::payload_bytes_sent();
  hp::comm::reset_collective_counts();
  reference.loss(0, mesh.get_local_rank(0)).backward();
  EXPECT_EQ(bytes, hp::comm::payload_bytes_sent());
  for (size_t i = 0; i < 3; ++i)
    EXPECT_TRUE(at::equal(net.parameters()[i].grad(), reference.parameters()[i].grad()));
}

// A rank whose options are refused (its row_sparse_parameters, or a zero bucket cap) still joins
// the layout exchange, with its error: its peers fail at once, naming that rank and its error,
// instead of waiting for it at the exchange until the timeout.
TEST(DataParallel, ARankThatRefusesItsOptionsFailsItsPeersAtOnce) {
  auto mesh = dp_mesh();
  Embedder net;
  auto stranger = at::zeros({4, 4}, at::TensorOptions().requires_grad(true));
  const std::vector<std::pair<dp::GradientReducerOptions, std::string>> refusals = {
      {dp::GradientReducerOptions().row_sparse_parameters({stranger}),
       "GradientReducer: expected row_sparse_parameters[0] to be one of the parameters it averages"},
      {dp::GradientReducerOptions().bucket_cap_bytes(0),
       "GradientReducer: expected bucket_cap_bytes > 0 and first_bucket_cap_bytes > 0, got 0 and"}};
  for (const auto& [refused, message] : refusals) {
    SCOPED_TRACE(message);
    const bool refuses = mesh.get_local_rank(0) == 0;
    const auto start = std::chrono::steady_clock::now();
    if (refuses) {
      HP_EXPECT_THROW_MSG((void)dp::data_parallel(net.parameters(), mesh, refused), message);
    } else {
      HP_EXPECT_THROW_MSG((void)dp::data_parallel(net.parameters(), mesh, dp::GradientReducerOptions()),
                          "to build its gradient buckets, got an error on rank 0: " + message);
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30)) << "not at once";
  }
  // The group is still usable: every rank made the same exchanges.
  auto reducer = dp::data_parallel(net, mesh);
  EXPECT_EQ(reducer->bucket_parameters().back(), std::vector<int64_t>{0});
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
