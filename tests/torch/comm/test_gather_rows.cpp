// gather_rows: bitwise the rows of the all-gathered matrix, at world sizes 1, 2, 3, 4 and 8, for
// fp32 and bf16, tables of 1 to 64 rows (empty pieces at 8 ranks), ids that differ per rank
// (none, some, all); exact bytes sent; every error a rank can cause fails on every rank.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm.h>

#include "common/test_util.h"

namespace comm = hyper_parallel::comm;

namespace {

at::Tensor table(int64_t rows, int64_t cols, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4000);
  return at::randn({rows, cols}, gen, at::TensorOptions(at::kDouble)).to(dtype);
}

// Rank q's ids: ascending and unique, every `every`-th row from q (none when every is 0).
at::Tensor ids_of(int64_t q, int64_t rows, int64_t every) {
  if (every == 0 || q % every >= rows) return at::empty({0}, at::kLong);
  return at::arange(q % every, rows, every, at::kLong);
}

at::Tensor shard_of(const at::Tensor& full) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank(), rows = full.size(0);
  return full.narrow(0, comm::chunk_offset(rows, p, r), comm::chunk_size(rows, p, r)).contiguous();
}

TEST(GatherRows, GivesTheGatheredMatrixsRowsBitwise) {
  const int64_t r = hp_test::rank();
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t rows : {1, 7, 37, 64}) {
      for (int64_t every : {0, 1, 3, 10}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + " rows " + std::to_string(rows) + " every " +
                     std::to_string(every));
        const auto full = table(rows, 5, dtype);
        const auto ids = ids_of(r, rows, every);
        const auto got = comm::gather_rows(shard_of(full), rows, ids, comm::world());
        EXPECT_TRUE(at::equal(got, full.index_select(0, ids)));
      }
    }
  }
}

// Each rank sends every other its count (8 bytes), the offsets of the rows it asks of it (8 bytes
// each) and the rows it was asked for (cols x 4 bytes each). One all_gather op is counted.
TEST(GatherRows, SendsOnlyTheRowsAskedFor) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank(), rows = 40, cols = 6;
  const auto full = table(rows, cols, at::kFloat);
  const auto chunk = (rows + p - 1) / p;
  int64_t expected = 0;
  for (int64_t q = 0; q < p; ++q) {
    if (q == r) continue;
    const auto mine = ids_of(r, rows, 3), theirs = ids_of(q, rows, 3);
    expected += 8 + 8 * mine.div(chunk, "floor").eq(q).sum().item<int64_t>() +
                cols * 4 * theirs.div(chunk, "floor").eq(r).sum().item<int64_t>();
  }
  comm::reset_collective_counts();
  comm::gather_rows(shard_of(full), rows, ids_of(r, rows, 3), comm::world());
  EXPECT_EQ(comm::payload_bytes_sent(), expected);
  EXPECT_EQ(comm::collective_count(comm::CollectiveKind::kAllGather), 1);
}

// Ids out of range, or not ascending and unique, on one rank: an IndexError on every rank that
// names that rank; then the group still works.
TEST(GatherRows, BadIdsOnOneRankFailOnEveryRank) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  const auto full = table(12, 3, at::kFloat);
  for (const auto& bad : {at::tensor({0, 12}, at::kLong), at::tensor({-1}, at::kLong),
                          at::tensor({3, 2}, at::kLong), at::tensor({4, 4}, at::kLong)}) {
    const auto ids = r == p - 1 ? bad : ids_of(r, 12, 2);
    const std::string who = r == p - 1 ? "this rank's" : "rank " + std::to_string(p - 1) + "'s";
    HP_EXPECT_THROW_MSG(comm::gather_rows(shard_of(full), 12, ids, comm::world()),
                        "expected every rank's ids ascending, unique and in [0, 12), got " + who);
  }
  const auto ids = ids_of(r, 12, 2);
  EXPECT_TRUE(
      at::equal(comm::gather_rows(shard_of(full), 12, ids, comm::world()), full.index_select(0, ids)));
}

TEST(GatherRows, RefusesWhatItCannotGather) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  const auto shard = shard_of(table(12, 3, at::kFloat));
  HP_EXPECT_THROW_MSG(comm::gather_rows(shard, 13 * p, at::zeros({0}, at::kLong), comm::world()),
                      "expected a shard of [" + std::to_string(comm::chunk_size(13 * p, p, r)) + ", cols]");
  HP_EXPECT_THROW_MSG(comm::gather_rows(shard, 12, at::zeros({1}, at::kInt), comm::world()),
                      "expected 1-D int64 ids, got Int");
  HP_EXPECT_THROW_MSG(comm::gather_rows(shard.to(at::kLong), 12, at::zeros({1}, at::kLong), comm::world()),
                      "expected a floating-point shard, got Long");
}

}  // namespace
