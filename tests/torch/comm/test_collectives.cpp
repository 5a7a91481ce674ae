// Ring collectives against closed-form values, for every dtype, world sizes 1..8, sizes that do
// not divide by the world size, and empty tensors.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm.h>

#include "common/test_util.h"

namespace hp = hyper_parallel;
using hp::comm::CollectiveKind;
using hp::comm::ReduceOp;
using hp_test::expect_close;

namespace {

// Values exact in every dtype (small integers): element i of rank r is (i % 16) + 16 r.
at::Tensor rank_values(int64_t r, at::IntArrayRef shape, at::ScalarType dtype) {
  int64_t n = 1;
  for (auto s : shape) n *= s;
  return (at::arange(n, at::kLong).remainder(16) + 16 * r).reshape(shape).to(dtype);
}

class Collectives : public ::testing::TestWithParam<at::ScalarType> {
 protected:
  hp::comm::Group world = hp::comm::world();
  int64_t p = world.size();
  int64_t r = world.rank();
  at::ScalarType dtype = GetParam();
};

TEST_P(Collectives, AllGatherEqualAndUnevenSizesAlongEveryDim) {
  for (int64_t dim : {0, 1, -1}) {
    for (bool uneven : {false, true}) {
      // Rank k holds extent (uneven ? k % 3 : 2) along `dim` (some ranks hold nothing).
      std::vector<int64_t> sizes;
      for (int64_t k = 0; k < p; ++k) sizes.push_back(uneven ? k % 3 : 2);
      auto shape_of = [&](int64_t k) {
        std::vector<int64_t> s{3, 4};
        s[dim < 0 ? dim + 2 : dim] = sizes[k];
        return s;
      };
      std::vector<at::Tensor> expected_parts;
      for (int64_t k = 0; k < p; ++k) expected_parts.push_back(rank_values(k, shape_of(k), dtype));
      auto out = hp::comm::all_gather(expected_parts[r], dim, world, sizes);
      EXPECT_TRUE(out.equal(at::cat(expected_parts, dim))) << "dim " << dim << " uneven " << uneven;
    }
  }
}

TEST_P(Collectives, AllGatherAlongAMiddleDimOfAStridedInput) {
  // [2, extent, 3] as a transposed view (not contiguous); rank k holds extent k % 3 + 2.
  std::vector<int64_t> sizes;
  std::vector<at::Tensor> parts;
  for (int64_t k = 0; k < p; ++k) {
    sizes.push_back(k % 3 + 2);
    parts.push_back(rank_values(k, {2, 3, sizes.back()}, dtype).transpose(1, 2));
  }
  ASSERT_FALSE(parts[r].is_contiguous());
  auto out = hp::comm::all_gather(parts[r], 1, world, sizes);
  EXPECT_TRUE(out.is_contiguous());
  EXPECT_TRUE(out.equal(at::cat(parts, 1)));
}

TEST_P(Collectives, ReduceScatterSumAndAvgWithTorchChunkSizes) {
  for (int64_t rows : {int64_t{0}, int64_t{1}, p, 2 * p + 1, int64_t{7}}) {
    for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
      auto input = rank_values(r, {rows, 3}, dtype);
      auto out = hp::comm::reduce_scatter(input, 0, op, world);
      // sum_k ((i % 16) + 16 k) = P (i % 16) + 16 P (P - 1) / 2
      auto base = at::arange(rows * 3, at::kDouble).remainder(16).reshape({rows, 3});
      auto expected = base * p + 16.0 * p * (p - 1) / 2;
      if (op == ReduceOp::kAvg) expected = expected / p;
      auto sizes = hp::comm::chunk_sizes(rows, p);
      int64_t offset = 0;
      for (int64_t k = 0; k < r; ++k) offset += sizes[k];
      expect_close(out, expected.narrow(0, offset, sizes[r]),
                   "rows " + std::to_string(rows) + " op " + hp::comm::to_string(op));
      EXPECT_EQ(out.scalar_type(), dtype);
    }
  }
}

TEST_P(Collectives, ReduceScatterAlongInnerDimWithExplicitSizes) {
  std::vector<int64_t> sizes;
  for (int64_t k = 0; k < p; ++k) sizes.push_back(k + 1);
  const int64_t cols = p * (p + 1) / 2;
  auto input = at::ones({2, cols}, dtype) * (r + 1);
  auto out = hp::comm::reduce_scatter(input, 1, ReduceOp::kSum, world, sizes);
  expect_close(out, at::full({2, r + 1}, double(p * (p + 1) / 2), at::kDouble));
}

TEST_P(Collectives, AllReduceIncludingFewerElementsThanRanks) {
  for (int64_t n : {int64_t{0}, int64_t{1}, p - 1, int64_t{33}}) {
    if (n < 0) continue;
    for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      if (op == ReduceOp::kAvg && !at::isFloatingType(dtype)) continue;
      auto out = hp::comm::all_reduce(rank_values(r, {n}, dtype), op, world);
      auto expected = at::arange(n, at::kDouble).remainder(16) * p + 16.0 * p * (p - 1) / 2;
      if (op == ReduceOp::kAvg) expected = expected / p;
      expect_close(out, expected, "n " + std::to_string(n));
    }
  }
}

TEST_P(Collectives, AllToAllUnevenSplits) {
  // Every rank holds rows 0..R-1 of a [R, 2] tensor (R not divisible by P); piece j goes to rank
  // j, and received pieces are concatenated along dim 1.
  const int64_t rows = 2 * p + 1;
  auto input = rank_values(r, {rows, 2}, dtype);
  auto out = hp::comm::all_to_all(input, /*split_dim=*/0, /*concat_dim=*/1, world);
  auto sizes = hp::comm::chunk_sizes(rows, p);
  int64_t offset = 0;
  for (int64_t k = 0; k < r; ++k) offset += sizes[k];
  std::vector<at::Tensor> parts;
  for (int64_t k = 0; k < p; ++k)
    parts.push_back(rank_values(k, {rows, 2}, dtype).narrow(0, offset, sizes[r]));
  EXPECT_TRUE(out.equal(at::cat(parts, 1)));
}

TEST_P(Collectives, BroadcastFromEveryRank) {
  for (int64_t src = 0; src < p; ++src) {
    auto out = hp::comm::broadcast(rank_values(r, {5}, dtype), src, world);
    EXPECT_TRUE(out.equal(rank_values(src, {5}, dtype))) << "src " << src;
  }
}

TEST_P(Collectives, BroadcastReturnsTheCallersOwnTensor) {
  // The source's result is a copy, whether its input was contiguous or a strided view.
  for (bool strided : {false, true}) {
    auto value_of = [&](int64_t k) {
      return strided ? rank_values(k, {3, 2}, dtype).t() : rank_values(k, {2, 3}, dtype);
    };
    auto input = value_of(r);
    const auto before = input.clone();
    auto out = hp::comm::broadcast(input, 0, world);
    EXPECT_TRUE(out.equal(value_of(0))) << "strided " << strided;
    out.add_(1);
    EXPECT_TRUE(input.equal(before)) << "the input changed with the result, strided " << strided;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Collectives,
                         ::testing::Values(at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kLong),
                         [](const auto& info) { return std::string(c10::toString(info.param)); });

// The dtypes the data-moving collectives take beside those above: the narrow integers and bool (a
// mask), moved as bytes; the reductions refuse them.
class DataMovement : public Collectives {
 protected:
  // Distinct per rank and element in every one of these dtypes (bool: a pattern shifted by rank).
  at::Tensor values(int64_t rank, at::IntArrayRef shape) const {
    if (dtype != at::kBool) return rank_values(rank, shape, dtype);
    return rank_values(rank, shape, at::kLong).remainder(3).eq(rank % 3);
  }
};

TEST_P(DataMovement, AllGatherAllToAllAndBroadcastMoveEveryByte) {
  const int64_t rows = 2 * p + 1;
  std::vector<at::Tensor> all;
  for (int64_t k = 0; k < p; ++k) all.push_back(values(k, {3, 2}));
  EXPECT_TRUE(hp::comm::all_gather(values(r, {3, 2}), 1, world).equal(at::cat(all, 1)));
  auto out = hp::comm::all_to_all(values(r, {rows, 2}), /*split_dim=*/0, /*concat_dim=*/1, world);
  const auto sizes = hp::comm::chunk_sizes(rows, p);
  int64_t offset = 0;
  for (int64_t k = 0; k < r; ++k) offset += sizes[k];
  std::vector<at::Tensor> parts;
  for (int64_t k = 0; k < p; ++k) parts.push_back(values(k, {rows, 2}).narrow(0, offset, sizes[r]));
  EXPECT_TRUE(out.equal(at::cat(parts, 1)));
  EXPECT_EQ(out.scalar_type(), dtype);
  for (int64_t src = 0; src < p; ++src) {
    EXPECT_TRUE(hp::comm::broadcast(values(r, {5}), src, world).equal(values(src, {5}))) << "src " << src;
  }
  HP_EXPECT_THROW_MSG(hp::comm::all_reduce(values(r, {4}), ReduceOp::kSum, world),
                      "all_reduce: expected dtype float32, float64, bfloat16, float16, int64 or int32, got");
  HP_EXPECT_THROW_MSG(
      hp::comm::reduce_scatter(values(r, {4}), 0, ReduceOp::kSum, world),
      "reduce_scatter: expected dtype float32, float64, bfloat16, float16, int64 or int32, got");
}

INSTANTIATE_TEST_SUITE_P(NarrowDtypes, DataMovement,
                         ::testing::Values(at::kShort, at::kChar, at::kByte, at::kBool),
                         [](const auto& info) { return std::string(c10::toString(info.param)); });

TEST(CollectivesNumerics, Bf16SumAccumulatesInFloat32AndRoundsOnce) {
  auto world = hp::comm::world();
  const int64_t p = world.size();
  if (p < 4) GTEST_SKIP() << "needs 4 ranks";
  // Rank 0 contributes 256, the others 1 each. Rounding at every hop would keep 256 (the bf16
  // spacing there is 2); accumulating in fp32 gives 256 + (P-1), rounded once.
  auto input = at::full({p * 4}, world.rank() == 0 ? 256.0 : 1.0, at::kBFloat16);
  auto out = hp::comm::reduce_scatter(input, 0, ReduceOp::kSum, world);
  auto expected = at::full({4}, 256.0 + (p - 1), at::kFloat).to(at::kBFloat16);
  EXPECT_TRUE(out.equal(expected)) << out;
  auto all = hp::comm::all_reduce(input, ReduceOp::kSum, world);
  EXPECT_TRUE(all.equal(at::full({p * 4}, 256.0 + (p - 1), at::kFloat).to(at::kBFloat16)));
}

// 16-bit reductions put 16 bits on the wire and sum in float32 at the destination, once: the
// result equals the float64 sum of the (exactly representable) inputs rounded once to the dtype,
// at every world size, for uneven sizes and for size 0.
TEST(CollectivesNumerics, SixteenBitReductionsRoundOnceAgainstFloat64) {
  auto world = hp::comm::world();
  const int64_t p = world.size(), r = world.rank();
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, 3 * p + 1, int64_t{1000}}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " n=" + std::to_string(n));
      // Every rank's values, known to every rank: exact in the dtype, their sums not.
      std::vector<at::Tensor> inputs;
      for (int64_t q = 0; q < p; ++q) {
        at::manual_seed(500 + q + n);
        inputs.push_back((at::randn({n}, at::kDouble) * 8).to(dtype));
      }
      auto exact = at::zeros({n}, at::kDouble);
      for (const auto& t : inputs) exact += t.to(at::kDouble);
      const auto rounded_once = exact.to(dtype);
      const auto sizes = hp::comm::chunk_sizes(n, p);
      const int64_t off = hp::comm::chunk_offset(n, p, r);
      auto rs = hp::comm::reduce_scatter(inputs[r], 0, ReduceOp::kSum, world);
      EXPECT_TRUE(rs.equal(rounded_once.narrow(0, off, sizes[r]))) << "reduce_scatter";
      EXPECT_TRUE(hp::comm::all_reduce(inputs[r], ReduceOp::kSum, world).equal(rounded_once)) << "all_reduce";
      // Payload: each rank sends the other ranks' blocks once, in 16 bits.
      hp::comm::reset_collective_counts();
      hp::comm::reduce_scatter(inputs[r], 0, ReduceOp::kSum, world);
      EXPECT_EQ(hp::comm::payload_bytes_sent(), (n - sizes[r]) * 2);
    }
  }
}

TEST(CollectivesNumerics, ReduceScatterIsBitwiseDeterministic) {
  auto world = hp::comm::world();
  at::manual_seed(1234 + world.rank());
  auto input = at::randn({64, 33}, at::kFloat);
  auto a = hp::comm::reduce_scatter(input, 0, ReduceOp::kSum, world);
  auto b = hp::comm::reduce_scatter(input, 0, ReduceOp::kSum, world);
  EXPECT_TRUE(a.equal(b));
}

TEST(CollectiveCounters, EachCallCountsOnceInItsRegion) {
  auto world = hp::comm::world();
  hp::comm::reset_collective_counts();
  auto x = at::ones({world.size() * 2}, at::kFloat);
  {
    hp::comm::CommRegion region("forward");
    hp::comm::all_gather(x, 0, world);
    hp::comm::reduce_scatter(x, 0, ReduceOp::kSum, world);
  }
  {
    hp::comm::CommRegion region("backward");
    hp::comm::all_reduce(x, ReduceOp::kSum, world);
    hp::comm::barrier(world);
  }
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllGather, "forward"), 1);
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kReduceScatter, "forward"), 1);
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllGather, "backward"), 0);
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllReduce, "backward"), 1);
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kBarrier), 1);
  EXPECT_EQ(hp::comm::total_collective_count(), 4);
  EXPECT_NE(hp::comm::collective_counts_summary().find("forward: all_gather=1"), std::string::npos);
}

TEST(P2P, AsyncSendRecvCompleteAroundLocalWork) {
  auto world = hp::comm::world();
  const int64_t p = world.size(), r = world.rank();
  if (p < 2) GTEST_SKIP() << "needs 2 ranks";
  auto out = at::full({1000}, double(r), at::kBFloat16);
  auto in = at::empty({1000}, at::kBFloat16);
  auto send = hp::comm::isend(out, (r + 1) % p, world, 5);
  auto recv = hp::comm::irecv(in, (r + p - 1) % p, world, 5);
  auto local = at::mm(at::ones({64, 64}), at::ones({64, 64}));  // runs while they are in flight
  recv.wait();
  send.wait();
  EXPECT_TRUE(in.equal(at::full({1000}, double((r + p - 1) % p), at::kBFloat16)));
}

TEST(CollectiveErrors, BadArgumentsNameTheFunctionAndValue) {
  auto world = hp::comm::world();
  const int64_t p = world.size();
  HP_EXPECT_THROW_MSG(hp::comm::all_gather(at::ones({2, 2}), 2, world),
                      "all_gather: expected dim in [-2, 2), got 2");
  HP_EXPECT_THROW_MSG(hp::comm::all_gather(at::ones({}), 0, world), "at least 1 dim");
  HP_EXPECT_THROW_MSG(hp::comm::reduce_scatter(at::ones({4}, at::kBool), 0, ReduceOp::kSum, world),
                      "reduce_scatter: expected dtype");
  HP_EXPECT_THROW_MSG(
      hp::comm::reduce_scatter(at::ones({4}), 0, ReduceOp::kSum, world, std::vector<int64_t>(p + 1, 0)),
      "expected one size per rank");
  HP_EXPECT_THROW_MSG(hp::comm::all_gather(at::ones({4}), 0, world, std::vector<int64_t>(p, 3)),
                      "to equal this rank's extent 4");
  HP_EXPECT_THROW_MSG(hp::comm::all_reduce(at::ones({4}, at::kLong), ReduceOp::kAvg, world),
                      "all_reduce: ReduceOp avg does not support integer dtype Long");
  HP_EXPECT_THROW_MSG(hp::comm::broadcast(at::ones({1}), p, world), "expected src in [0,");
  HP_EXPECT_THROW_MSG(hp::comm::isend(at::ones({2}), p, world, 0), "isend: expected peer rank in");
  HP_EXPECT_THROW_MSG(hp::comm::isend(at::ones({2}), world.rank(), world, 0),
                      "expected a peer other than this rank");
  HP_EXPECT_THROW_MSG(hp::comm::irecv(at::ones({4, 4}).t(), (world.rank() + 1) % p, world, 0),
                      "expected a contiguous tensor");
  HP_EXPECT_THROW_MSG(hp::comm::Group().rank(), "non-member");
  HP_EXPECT_THROW_MSG(hp::comm::all_to_all(at::ones({4, 4}), 0, 0, world),
                      "expected split_dim != concat_dim");
  HP_EXPECT_THROW_MSG(hp::comm::all_to_all(at::ones({4, 4}), 0, 1, world, {}, std::vector<int64_t>(p, 5)),
                      "expected recv_concat_sizes[" + std::to_string(world.rank()) +
                          "] to equal this rank's extent 4, got 5");
  HP_EXPECT_THROW_MSG(hp::comm::init_process_group(), "already initialised");
}

TEST(Groups, SubGroupsOfEvenAndOddRanks) {
  auto world = hp::comm::world();
  const int64_t p = world.size(), r = world.rank();
  std::vector<int64_t> even, odd;
  for (int64_t k = 0; k < p; ++k) (k % 2 ? odd : even).push_back(k);
  auto g_even = hp::comm::new_group(even);
  auto g_odd = odd.empty() ? hp::comm::Group() : hp::comm::new_group(odd);
  auto& mine = r % 2 ? g_odd : g_even;
  ASSERT_TRUE(mine.is_member());
  EXPECT_FALSE((r % 2 ? g_even : g_odd).is_member());
  auto sum = hp::comm::all_reduce(at::full({1}, double(r), at::kDouble), ReduceOp::kSum, mine);
  double expected = 0;
  for (auto k : (r % 2 ? odd : even)) expected += k;
  EXPECT_EQ(sum.item<double>(), expected);
  HP_EXPECT_THROW_MSG(hp::comm::new_group({0, 0}), "expected distinct ranks");
  HP_EXPECT_THROW_MSG(hp::comm::new_group({p}), "new_group: expected ranks[0] in [0,");
}

}  // namespace

namespace {

// The reduce-scatter schedules run `while_in_flight` exactly once, once this rank's partials
// are on the wire (direct: every one; ring: step 0's), and the result does not depend on it.
TEST(ReduceScatterSchedules, RunTheInFlightWorkOnceWithTheSameResult) {
  const auto world = hp::comm::world();
  const int64_t p = world.size(), r = world.rank();
  const hp::comm::BlockLayout layout(std::vector<int64_t>(p, 6), /*chunks=*/2);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    at::manual_seed(40 + r);
    const auto input = at::randn({layout.total_rows(), 5}).to(dtype);
    const auto options = input.options();
    int partials = 0, partials_before_work = -1, runs = 0;
    auto run = [&](const hp::comm::InFlightFn& work) {
      if (hp::comm::reduces_directly(dtype)) {
        return hp::comm::direct_reduce_scatter(
            layout, 5, options, world,
            [&](int64_t block, int64_t j) {
              ++partials;
              return layout.chunk(input, block, j);
            },
            work);
      }
      return hp::comm::ring_reduce_scatter(
          layout, 5, options, world,
          [&](int64_t block, int64_t j, const std::function<at::Tensor()>& arrived) {
            ++partials;
            auto part = layout.chunk(input, block, j).to(at::kFloat);
            auto sum = arrived();
            return sum.defined() ? sum.add_(part) : part.contiguous();
          },
          work);
    };
    const auto plain = run({});
    partials = 0;
    const auto with_work = run([&] {
      ++runs;
      partials_before_work = partials;
    });
    EXPECT_EQ(runs, 1);
    EXPECT_TRUE(at::equal(plain, with_work)) << "bitwise";
    // Direct: the (P - 1) x chunks remote partials come first, this rank's own after the work;
    // ring: step 0's chunks and the first partial of step 1, which the callback computes before
    // it asks for the arrived sum; one rank: its own partials, then the work.
    const int64_t expected = p == 1 ? 2 : (hp::comm::reduces_directly(dtype) ? (p - 1) * 2 : 3);
    EXPECT_EQ(partials_before_work, expected);
  }
}

}  // namespace
