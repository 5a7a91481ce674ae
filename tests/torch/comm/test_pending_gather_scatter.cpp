// PendingAllGather and PendingReduceScatter: the direct one-round collectives fully_shard starts
// ahead of their use. The all-gather is bitwise the schedule engine's all_gather; the
// reduce-scatter equals a float64 reference and is bitwise the PendingAllReduce's block of this
// rank; for world sizes 1..8 (non-powers of two included), sizes 0, 1, fewer than P and uneven
// blocks, several in flight at once, one counted collective each.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm.h>

#include "common/test_util.h"

namespace comm = hyper_parallel::comm;

namespace {

at::Tensor input_of(int64_t q, int64_t numel, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2000 + q);
  return at::randn({numel}, gen, at::TensorOptions(at::kDouble)).to(dtype);
}

TEST(PendingAllGather, IsBitwiseTheAllGatherOfEveryRanksInput) {
  const int64_t p = hp_test::world_size();
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    for (int64_t numel : {int64_t{0}, int64_t{1}, p - 1, 3 * p + 1, int64_t{1000}}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " numel " + std::to_string(numel));
      auto input = input_of(hp_test::rank(), numel, dtype);
      auto pending = comm::start_all_gather(input, comm::world());
      input.zero_();  // read when started: a change after that does not travel
      const auto all = pending.wait();
      ASSERT_EQ(all.numel(), p * numel);
      for (int64_t q = 0; q < p; ++q) {
        EXPECT_TRUE(all.narrow(0, q * numel, numel).equal(input_of(q, numel, dtype))) << "rank " << q;
      }
      EXPECT_TRUE(pending.wait().equal(all)) << "a second wait returns the same tensor";
    }
  }
}

TEST(PendingReduceScatter, EqualsTheReferenceAndIsBitwiseThePendingAllReducesBlock) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    for (auto op : {comm::ReduceOp::kSum, comm::ReduceOp::kAvg}) {
      for (int64_t numel : {int64_t{0}, int64_t{1}, p - 1, 3 * p + 1, int64_t{1000}}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + " " + comm::to_string(op) + " numel " +
                     std::to_string(numel));
        auto sum = at::zeros({numel}, at::kDouble);
        for (int64_t q = 0; q < p; ++q) sum += input_of(q, numel, dtype).to(at::kDouble);
        if (op == comm::ReduceOp::kAvg) sum /= double(p);
        const auto block = [&](const at::Tensor& t) {
          return t.narrow(0, comm::chunk_offset(numel, p, r), comm::chunk_size(numel, p, r));
        };
        auto buffer = input_of(r, numel, dtype);
        auto mine = comm::start_reduce_scatter(buffer, op, comm::world()).wait();
        hp_test::expect_close(mine, block(sum).to(dtype));
        auto all_reduced = input_of(r, numel, dtype);
        comm::start_all_reduce(all_reduced, op, comm::world()).wait();
        EXPECT_TRUE(mine.equal(block(all_reduced)));
      }
    }
  }
}

TEST(PendingGatherScatter, SeveralInFlightCountOneCollectiveEach) {
  const int64_t n = 4, p = hp_test::world_size();
  comm::reset_collective_counts();
  std::vector<comm::PendingAllGather> gathers;
  std::vector<comm::PendingReduceScatter> scatters;
  std::vector<at::Tensor> buffers;
  for (int64_t k = 0; k < n; ++k) {
    gathers.push_back(
        comm::start_all_gather(input_of(hp_test::rank(), 10 * (k + 1), at::kFloat), comm::world()));
    buffers.push_back(input_of(hp_test::rank(), 7 * (k + 1), at::kBFloat16));
    scatters.push_back(comm::start_reduce_scatter(buffers.back(), comm::ReduceOp::kSum, comm::world()));
  }
  EXPECT_EQ(comm::collective_count(comm::CollectiveKind::kAllGather), n);
  EXPECT_EQ(comm::collective_count(comm::CollectiveKind::kReduceScatter), n);
  // Waited in the reverse order of their starts: each completes on its own.
  for (int64_t k = n - 1; k >= 0; --k) {
    EXPECT_EQ(gathers[k].wait().numel(), p * 10 * (k + 1));
    EXPECT_EQ(scatters[k].wait().numel(), comm::chunk_size(7 * (k + 1), p, hp_test::rank()));
  }
}

TEST(PendingGatherScatter, ErrorsNameWhatWasExpected) {
  HP_EXPECT_THROW_MSG(
      comm::start_reduce_scatter(at::ones({4}, at::kLong), comm::ReduceOp::kSum, comm::world()),
      "start_reduce_scatter: expected a floating-point tensor, got Long");
  HP_EXPECT_THROW_MSG(comm::start_reduce_scatter(at::ones({4, 4}).t(), comm::ReduceOp::kSum, comm::world()),
                      "start_reduce_scatter: expected a contiguous buffer");
  HP_EXPECT_THROW_MSG(comm::start_all_gather(at::Tensor(), comm::world()),
                      "start_all_gather: expected a tensor, got an undefined one");
}

}  // namespace
