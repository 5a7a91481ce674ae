// MC2's deferred weight gradients (MC2Options::defer_weight_grads): a row Linear's dW and the
// dW of a layer sharing a gather run in the next backward gather's window (a row Linear's, or
// the one under a reduce-scatter redistribute like the embedding's) and reach autograd after
// that gather. The gradients are bitwise those of the serial
// order, at world sizes 1, 2, 3, 4 and 8, in bf16 and float32, with and without a shared
// gather, over accumulation, retain_graph and autograd::grad.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <hyper_parallel/core/comm.h>
#include <hyper_parallel/core/dtensor/device_mesh.h>
#include <hyper_parallel/core/dtensor/dtensor.h>
#include <hyper_parallel/core/tensor_parallel/mc2/fused_linear.h>

#include "common/test_util.h"

namespace hp = hyper_parallel;
namespace tp = hp::tensor_parallel;

namespace {

// Local shards of a row Linear (the attention's wo) followed by a sequence-parallel SwiGLU
// block: h [P m, f] -> row(w0 [k, f]) -> x [m, k] (this rank's rows) -> w1 and w3 [f, k]
// (column) -> w2 [k, f] (row), with biases. w3's and w2's dW defer into w0's gather window.
struct Block {
  at::Tensor h, w0, b0, w1, b1, w3, b3, w2, b2, upstream;

  Block(int64_t m, int64_t k, int64_t f, at::ScalarType dtype) {
    at::manual_seed(100 + hp_test::rank());
    auto leaf = [&](std::vector<int64_t> sizes) { return at::randn(sizes).to(dtype).requires_grad_(true); };
    h = leaf({hp_test::world_size() * m, f});
    w0 = leaf({k, f}), b0 = leaf({k});
    w1 = leaf({f, k}), b1 = leaf({f}), w3 = leaf({f, k}), b3 = leaf({f}), w2 = leaf({k, f}), b2 = leaf({k});
    upstream = at::randn({m, k}).to(dtype);
  }
  std::vector<at::Tensor> leaves() const { return {h, w0, b0, w1, b1, w3, b3, w2, b2}; }

  // shared = false: w3 gathers on its own instead of multiplying w1's gather.
  at::Tensor forward(const tp::MC2Options& options, bool shared) const {
    auto group = hp::comm::world();
    auto x = tp::mc2_row_linear(h, w0, b0, group, options);
    auto [y1, gathered] = tp::mc2_column_linear_gathered(x, w1, b1, group, options);
    auto y3 = shared ? tp::mc2_shared_column_linear(gathered, w3, b3, options)
                     : tp::mc2_column_linear(x, w3, b3, group, options);
    return tp::mc2_row_linear(at::silu(y1) * y3, w2, b2, group, options);
  }
  at::Tensor loss(const tp::MC2Options& options, bool shared) const {
    return (forward(options, shared) * upstream).sum();
  }
  std::vector<at::Tensor> grads() const {
    std::vector<at::Tensor> out;
    for (const auto& t : leaves()) out.push_back(t.grad().clone());
    return out;
  }
  void zero_grads() const {
    for (auto t : leaves()) t.mutable_grad() = at::Tensor();
  }
};

const std::vector<std::string> kNames = {"h", "w0", "b0", "w1", "b1", "w3", "b3", "w2", "b2"};

void expect_bitwise(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(a[i].defined() && b[i].defined()) << kNames[i];
    EXPECT_TRUE(at::equal(a[i], b[i]))
        << kNames[i] << ": max abs diff "
        << (a[i].to(at::kDouble) - b[i].to(at::kDouble)).abs().max().item<double>();
  }
}

const auto kDeferred = tp::MC2Options();
const auto kSerial = tp::MC2Options().defer_weight_grads(false);

TEST(DeferredWeightGrads, BitwiseTheSerialOrder) {
  for (auto dtype : {at::kBFloat16, at::kFloat}) {
    for (bool shared : {true, false}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + (shared ? " shared gather" : " own gathers"));
      Block block(6, 64, 48, dtype);
      block.loss(kSerial, shared).backward();
      auto serial = block.grads();
      block.zero_grads();
      block.loss(kDeferred, shared).backward();
      expect_bitwise(block.grads(), serial);
    }
  }
}

TEST(DeferredWeightGrads, ZeroRowsPerRank) {
  Block block(0, 32, 16, at::kFloat);
  block.loss(kSerial, true).backward();
  auto serial = block.grads();
  block.zero_grads();
  block.loss(kDeferred, true).backward();
  expect_bitwise(block.grads(), serial);
  EXPECT_EQ(block.w2.grad().abs().sum().item<double>(), 0.0);
}

// Records, while alive, the order in which the named tensors' gradients reach autograd.
class ArrivalOrder {
 public:
  explicit ArrivalOrder(const std::vector<std::pair<at::Tensor, std::string>>& named) {
    for (const auto& [t, name] : named) {
      hooks_.emplace_back(t, t.register_hook([this, n = name](const at::Tensor&) { order_.push_back(n); }));
    }
  }
  ~ArrivalOrder() {
    for (auto& [t, id] : hooks_) t.remove_hook(id);
  }
  ArrivalOrder(const ArrivalOrder&) = delete;
  ArrivalOrder& operator=(const ArrivalOrder&) = delete;
  const std::vector<std::string>& order() const { return order_; }

 private:
  std::vector<std::string> order_;
  std::vector<std::pair<at::Tensor, unsigned>> hooks_;
};

// The order in which the weights' gradients reach autograd: serially each in its own node, in
// backward order; deferred, w3's and w2's after w0's (they ran in w0's gather window).
std::vector<std::string> arrival_order(const tp::MC2Options& options) {
  Block block(4, 32, 16, at::kFloat);
  ArrivalOrder arrivals({{block.w0, "w0"}, {block.w1, "w1"}, {block.w3, "w3"}, {block.w2, "w2"}});
  block.loss(options, true).backward();
  return arrivals.order();
}

TEST(DeferredWeightGrads, ArriveAfterTheHostRowsOwn) {
  EXPECT_EQ(arrival_order(kSerial), (std::vector<std::string>{"w2", "w3", "w1", "w0"}));
  auto deferred = arrival_order(kDeferred);
  ASSERT_EQ(deferred.size(), 4u);
  EXPECT_EQ(std::vector<std::string>(deferred.begin(), deferred.begin() + 2),
            (std::vector<std::string>{"w1", "w0"}));
  std::sort(deferred.begin() + 2, deferred.end());
  EXPECT_EQ(std::vector<std::string>(deferred.begin() + 2, deferred.end()),
            (std::vector<std::string>{"w2", "w3"}));
}

// The embedding's case: the first MC2 layers have no row before them, but a Partial -> Shard
// redistribute (the embedding's reduce-scatter) gathers in backward. Returns the order in which
// the gradients of e (the partial input), w1, w3 and w2 reach autograd, and the gradients.
std::pair<std::vector<std::string>, std::vector<at::Tensor>> after_a_reduce_scatter(
    const tp::MC2Options& options) {
  Block block(4, 32, 16, at::kFloat);
  const auto group = hp::comm::world();
  const auto mesh = hp::dtensor::init_device_mesh("cpu", {hp_test::world_size()}, {"tp"});
  at::manual_seed(11 + hp_test::rank());
  const auto e = at::randn({hp_test::world_size() * 4, 32}).requires_grad_(true);
  ArrivalOrder arrivals({{e, "e"}, {block.w1, "w1"}, {block.w3, "w3"}, {block.w2, "w2"}});
  auto x = hp::dtensor::DTensor::from_local(e, mesh, {hp::dtensor::Partial()})
               .redistribute({hp::dtensor::Shard(0)})
               .to_local();
  auto [y1, gathered] = tp::mc2_column_linear_gathered(x, block.w1, block.b1, group, options);
  auto y3 = tp::mc2_shared_column_linear(gathered, block.w3, block.b3, options);
  auto y = tp::mc2_row_linear(at::silu(y1) * y3, block.w2, block.b2, group, options);
  (y * block.upstream).sum().backward();
  return {arrivals.order(),
          {e.grad(), block.w1.grad(), block.b1.grad(), block.w3.grad(), block.b3.grad(), block.w2.grad(),
           block.b2.grad()}};
}

TEST(DeferredWeightGrads, AReduceScatterBeforeThemHostsTheFirstLayersJobs) {
  const auto [serial_order, serial] = after_a_reduce_scatter(kSerial);
  EXPECT_EQ(serial_order, (std::vector<std::string>{"w2", "w3", "w1", "e"}));
  auto [order, grads] = after_a_reduce_scatter(kDeferred);
  // w3's and w2's dW ran in the redistribute backward's gather: they arrive after w1's.
  ASSERT_EQ(order.size(), 4u);
  EXPECT_EQ(order[0], "w1");
  std::sort(order.begin() + 1, order.end());
  EXPECT_EQ(std::vector<std::string>(order.begin() + 1, order.end()),
            (std::vector<std::string>{"e", "w2", "w3"}));
  ASSERT_EQ(grads.size(), serial.size());
  for (size_t i = 0; i < grads.size(); ++i) EXPECT_TRUE(at::equal(grads[i], serial[i])) << i;
}

TEST(DeferredWeightGrads, AccumulationRetainGraphAndAutogradGrad) {
  Block block(4, 32, 16, at::kBFloat16);
  for (int pass = 0; pass < 2; ++pass) block.loss(kSerial, true).backward();
  const auto serial = block.grads();
  block.zero_grads();
  for (int pass = 0; pass < 2; ++pass) block.loss(kDeferred, true).backward();
  expect_bitwise(block.grads(), serial);
  // One graph, kept, backwarded twice: each pass posts and delivers its own jobs.
  block.zero_grads();
  auto kept = block.loss(kDeferred, true);
  kept.backward({}, /*retain_graph=*/true);
  kept.backward();
  expect_bitwise(block.grads(), serial);
  // autograd::grad for h alone posts weight jobs nobody delivers; the next pass is unaffected.
  block.zero_grads();
  auto dx = torch::autograd::grad({block.loss(kDeferred, true)}, {block.h});
  auto dx_serial = torch::autograd::grad({block.loss(kSerial, true)}, {block.h});
  EXPECT_TRUE(at::equal(dx[0], dx_serial[0]));
  block.loss(kDeferred, true).backward();
  const auto once = block.grads();
  block.zero_grads();
  block.loss(kSerial, true).backward();
  expect_bitwise(once, block.grads());
}

// Row -> column + shared column, no row after: autograd::grad stopping at the row's output
// leaves w3's job posted and unrun (its host, w0's node, does not run); the same retained
// graph's full backward posts it again before any window and delivers the new one.
TEST(DeferredWeightGrads, AJobLeftUnrunIsReplacedByTheNextPass) {
  Block block(4, 32, 16, at::kFloat);
  auto group = hp::comm::world();
  auto run = [&](const tp::MC2Options& o) {
    auto x = tp::mc2_row_linear(block.h, block.w0, block.b0, group, o);
    auto [y1, gathered] = tp::mc2_column_linear_gathered(x, block.w1, block.b1, group, o);
    auto y3 = tp::mc2_shared_column_linear(gathered, block.w3, block.b3, o);
    auto loss = (at::silu(y1) * y3).sum();
    auto dx = torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true);
    loss.backward();
    return dx[0];
  };
  auto grads = [&] {  // w2 and b2 are not used here
    return std::vector<at::Tensor>{block.h.grad(),  block.w0.grad(), block.b0.grad(), block.w1.grad(),
                                   block.b1.grad(), block.w3.grad(), block.b3.grad()};
  };
  const auto dx_serial = run(kSerial);
  const auto serial = grads();
  block.zero_grads();
  EXPECT_TRUE(at::equal(run(kDeferred), dx_serial));
  const auto deferred = grads();
  for (size_t i = 0; i < serial.size(); ++i) {
    ASSERT_TRUE(serial[i].defined() && deferred[i].defined()) << kNames[i];
    EXPECT_TRUE(at::equal(serial[i], deferred[i])) << kNames[i];
  }
}

TEST(DeferredWeightGrads, RowAloneAndFrozenWeights) {
  Block block(4, 32, 16, at::kFloat);
  auto group = hp::comm::world();
  // A row Linear with no row before it: no window, so its own node computes dW.
  at::manual_seed(7);
  const auto input = at::randn({hp_test::world_size() * 4, 16}).requires_grad_(true);
  auto row_loss = [&](const tp::MC2Options& o) {
    return (tp::mc2_row_linear(input, block.w2, block.b2, group, o) * block.upstream).sum();
  };
  row_loss(kSerial).backward();
  auto serial = block.w2.grad().clone();
  block.zero_grads();
  row_loss(kDeferred).backward();
  EXPECT_TRUE(at::equal(block.w2.grad(), serial));
  // Frozen weights and biases: nothing to defer, the input gradient as before.
  for (auto t : {block.w0, block.b0, block.w1, block.b1, block.w3, block.b3, block.w2, block.b2}) {
    t.requires_grad_(false);
  }
  block.zero_grads();
  block.loss(kSerial, true).backward();
  auto dh = block.h.grad().clone();
  block.zero_grads();
  block.loss(kDeferred, true).backward();
  EXPECT_TRUE(at::equal(block.h.grad(), dh));
  EXPECT_FALSE(block.w2.grad().defined());
}

}  // namespace
