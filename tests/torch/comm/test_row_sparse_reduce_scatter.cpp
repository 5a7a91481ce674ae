// start_row_sparse_reduce_scatter: bitwise the dense start_reduce_scatter's block on every rank,
// for world sizes 1, 2, 3, 4 and 8, every float dtype, sum and average; rows that some ranks
// have and others lack, rows every rank has, a row of -0.0, blocks with no rows, one-row blocks.
// The bytes sent are exact: the counts, then each rank's rows of each owner's block, or the
// dense reduce-scatter's where that moves fewer.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm.h>

#include "common/test_util.h"

namespace comm = hyper_parallel::comm;

namespace {

// Rank q's buffer: P blocks of block_rows x cols; row i is nonzero where (i + q) % every == 0
// (a different set on each rank) or, with `shared` > 0, where i % shared == 0 (on every rank);
// row 1 is -0.0 on rank 0 only.
at::Tensor input_of(int64_t q, int64_t block_rows, int64_t cols, int64_t every, at::ScalarType dtype,
                    int64_t shared = 0) {
  const int64_t rows = hp_test::world_size() * block_rows;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3000 + q);
  auto matrix = at::randn({rows, cols}, gen, at::TensorOptions(at::kDouble)).to(dtype);
  for (int64_t i = 0; i < rows; ++i) {
    if ((i + q) % every != 0 && (shared == 0 || i % shared != 0)) matrix[i].zero_();
  }
  if (q == 0 && rows > 1 && every > 1) matrix[1].fill_(-0.0);
  return matrix.view({-1});
}

// Bitwise: as integers, so that -0.0 and +0.0 differ.
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  const auto word = a.element_size() == 2 ? at::kShort : a.element_size() == 4 ? at::kInt : at::kLong;
  return a.sizes() == b.sizes() && at::equal(a.view(word), b.view(word));
}

struct Case {
  int64_t block_rows, cols, every, shared = 0;
};

TEST(RowSparseReduceScatter, GivesTheDenseReduceScattersBitsOnEveryRank) {
  const int64_t r = hp_test::rank();
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    for (auto op : {comm::ReduceOp::kSum, comm::ReduceOp::kAvg}) {
      for (const auto& c : {Case{16, 16, 8}, Case{16, 16, 1}, Case{7, 5, 3}, Case{0, 16, 1}, Case{5, 4, 1000},
                            Case{1, 1, 1}, Case{64, 64, 64, 32}, Case{3, 8, 2, 5}}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + " " + comm::to_string(op) + " block rows " +
                     std::to_string(c.block_rows) + " cols " + std::to_string(c.cols) + " every " +
                     std::to_string(c.every) + " shared " + std::to_string(c.shared));
        auto dense = input_of(r, c.block_rows, c.cols, c.every, dtype, c.shared);
        auto sparse = dense.clone();
        const auto expected = comm::start_reduce_scatter(dense, op, comm::world()).wait();
        const auto got = comm::start_row_sparse_reduce_scatter(sparse, c.cols, op, comm::world()).wait();
        EXPECT_TRUE(same_bits(got, expected))
            << "max abs diff " << (got.to(at::kDouble) - expected.to(at::kDouble)).abs().max();
        EXPECT_EQ(got.data_ptr(), static_cast<char*>(sparse.data_ptr()) + r * got.nbytes())
            << "expected this rank's block of the buffer, in place";
      }
    }
  }
}

// Rows of 40000 elements: the union is summed 3 rows at a time (slices of 2^17 elements), and
// the rows every rank has (multiples of 4) sum P operands across slices.
TEST(RowSparseReduceScatter, SumsTheUnionASliceOfRowsAtATime) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto dense = input_of(r, 24, 40000, 16, dtype, /*shared=*/4);
    auto sparse = dense.clone();
    comm::reset_collective_counts();
    const auto expected = comm::start_reduce_scatter(dense, comm::ReduceOp::kAvg, comm::world()).wait();
    const int64_t dense_bytes = comm::payload_bytes_sent();
    comm::reset_collective_counts();
    const auto got =
        comm::start_row_sparse_reduce_scatter(sparse, 40000, comm::ReduceOp::kAvg, comm::world()).wait();
    if (p > 1) {
      EXPECT_LT(comm::payload_bytes_sent(), dense_bytes) << "expected the sparse path";
    }
    EXPECT_TRUE(same_bits(got, expected));
  }
}

// 8 rows of 16 fp32 per block, every 8th row on each rank: one row per block, and rank 0's row 1
// of -0.0 too. Each rank sends its P counts (8 P bytes) to each of the P - 1 others, then to
// each owner its rows of the owner's block: 8 bytes of index and 64 of values per row. With
// every row on every rank, the dense reduce-scatter's bytes ((P - 1) / P of the buffer) after
// the counts.
TEST(RowSparseReduceScatter, SendsOnlyTheRowsOfEachOwnersBlockOrTheDenseBytesWhereFewer) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  if (p == 1) GTEST_SKIP() << "one rank sends nothing";
  auto sparse = input_of(r, 8, 16, 8, at::kFloat);
  comm::reset_collective_counts();
  comm::start_row_sparse_reduce_scatter(sparse, 16, comm::ReduceOp::kAvg, comm::world()).wait();
  // Rank 0's rows: 0, 8, 16, ... and -0.0 row 1 (in block 0, its own); others': one per block.
  const int64_t rows_sent = p - 1;
  EXPECT_EQ(comm::payload_bytes_sent(), (p - 1) * 8 * p + rows_sent * (8 + 16 * 4));
  EXPECT_EQ(comm::collective_count(comm::CollectiveKind::kReduceScatter), 1);

  auto dense_rows = input_of(r, 8, 16, 1, at::kFloat);
  auto reference = dense_rows.clone();
  comm::reset_collective_counts();
  const auto expected = comm::start_reduce_scatter(reference, comm::ReduceOp::kAvg, comm::world()).wait();
  const int64_t dense_bytes = comm::payload_bytes_sent();
  comm::reset_collective_counts();
  const auto got =
      comm::start_row_sparse_reduce_scatter(dense_rows, 16, comm::ReduceOp::kAvg, comm::world()).wait();
  EXPECT_EQ(comm::payload_bytes_sent(), (p - 1) * 8 * p + dense_bytes);
  EXPECT_TRUE(same_bits(got, expected));
}

TEST(RowSparseReduceScatter, RefusesWhatItCannotReduce) {
  const int64_t p = hp_test::world_size();
  HP_EXPECT_THROW_MSG(
      comm::start_row_sparse_reduce_scatter(at::zeros({p * 6}), 0, comm::ReduceOp::kSum, comm::world()),
      "expected cols >= 1 and " + std::to_string(p) + " blocks of whole rows");
  HP_EXPECT_THROW_MSG(
      comm::start_row_sparse_reduce_scatter(at::zeros({p * 6 + 1}), 3, comm::ReduceOp::kSum, comm::world()),
      "got numel " + std::to_string(p * 6 + 1) + " and cols 3");
  HP_EXPECT_THROW_MSG(comm::start_row_sparse_reduce_scatter(at::zeros({p * 6}, at::kLong), 3,
                                                            comm::ReduceOp::kSum, comm::world()),
                      "expected a floating-point tensor, got Long");
  HP_EXPECT_THROW_MSG(
      comm::start_row_sparse_reduce_scatter(at::zeros({p, 6}), 3, comm::ReduceOp::kSum, comm::world()),
      "expected a contiguous 1-D buffer, got sizes [" + std::to_string(p) + ", 6]");
}

}  // namespace
