// start_row_sparse_all_reduce: bitwise the dense start_all_reduce's result, on every rank, for
// world sizes 1, 2, 3, 4 and 8, every float dtype, sum and average; rows that
// some ranks have and others lack, rows of -0.0, no rows, no columns, dense tails of 0, 1 and 3
// elements. The bytes sent are exact: the rows any rank has, or a dense all-reduce's where that
// moves fewer.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm.h>

#include "common/test_util.h"

namespace comm = hyper_parallel::comm;

namespace {

// Rank q's buffer: a rows x cols matrix whose row i is nonzero where (i + q) % every == 0 (rows
// every-th apart, a different set on each rank) or, with `shared` > 0, i % shared == 0 (on every
// rank: sums of P operands), row 1 -0.0 on rank 0 only, then `tail` dense elements.
at::Tensor input_of(int64_t q, int64_t rows, int64_t cols, int64_t every, int64_t tail, at::ScalarType dtype,
                    int64_t shared = 0) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2000 + q);
  auto matrix = at::randn({rows, cols}, gen, at::TensorOptions(at::kDouble)).to(dtype);
  for (int64_t i = 0; i < rows; ++i) {
    if ((i + q) % every != 0 && (shared == 0 || i % shared != 0)) matrix[i].zero_();
  }
  if (q == 0 && rows > 1 && every > 1) matrix[1].fill_(-0.0);
  return at::cat({matrix.view({-1}), at::randn({tail}, gen, at::TensorOptions(at::kDouble)).to(dtype)});
}

// Bitwise: as integers, so that -0.0 and +0.0 differ.
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  const auto word = a.element_size() == 2 ? at::kShort : a.element_size() == 4 ? at::kInt : at::kLong;
  return a.sizes() == b.sizes() && at::equal(a.view(word), b.view(word));
}

void expect_equal_on_every_rank(const at::Tensor& result) {
  auto all = comm::all_gather(result.view({1, -1}), 0, comm::world());
  for (int64_t q = 1; q < all.size(0); ++q) EXPECT_TRUE(same_bits(all[q], all[0])) << "rank " << q;
}

struct Case {
  int64_t rows, cols, every, tail, shared = 0;
};

TEST(RowSparseAllReduce, GivesTheDenseAllReducesBitsOnEveryRank) {
  const int64_t r = hp_test::rank();
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    for (auto op : {comm::ReduceOp::kSum, comm::ReduceOp::kAvg}) {
      for (const auto& c :
           {Case{64, 16, 8, 1}, Case{64, 16, 1, 1}, Case{37, 5, 3, 3}, Case{0, 16, 1, 1}, Case{9, 0, 1, 2},
            Case{20, 4, 1000, 0}, Case{1, 1, 1, 0}, Case{256, 64, 64, 1, 32}}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + " " + comm::to_string(op) + " rows " +
                     std::to_string(c.rows) + " cols " + std::to_string(c.cols) + " every " +
                     std::to_string(c.every) + " tail " + std::to_string(c.tail));
        auto dense = input_of(r, c.rows, c.cols, c.every, c.tail, dtype, c.shared);
        auto sparse = dense.clone();
        comm::start_all_reduce(dense, op, comm::world()).wait();
        comm::start_row_sparse_all_reduce(sparse, c.rows, c.cols, op, comm::world()).wait();
        EXPECT_TRUE(same_bits(sparse, dense))
            << "max abs diff " << (sparse.to(at::kDouble) - dense.to(at::kDouble)).abs().max();
        if (c.rows > 1 && c.cols > 0) {  // row 1: -0.0 on rank 0 (equal bits, sign included)
          EXPECT_EQ(std::signbit(sparse[c.cols].item<double>()), std::signbit(dense[c.cols].item<double>()));
        }
        expect_equal_on_every_rank(sparse);
      }
    }
  }
}

// Rows of 40000 elements: the union is summed 3 rows at a time (slices of 2^17 elements), so a
// rank's rows fall in many slices, some in none, and the rows every rank has (0, 16, 32) sum
// P operands across slices. Sparse at every world size here (fewer bytes than dense).
TEST(RowSparseAllReduce, SumsTheUnionASliceOfRowsAtATime) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (auto op : {comm::ReduceOp::kSum, comm::ReduceOp::kAvg}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " " + comm::to_string(op));
      auto dense = input_of(r, 48, 40000, 8, 3, dtype, /*shared=*/16);
      auto sparse = dense.clone();
      comm::reset_collective_counts();
      comm::start_all_reduce(dense, op, comm::world()).wait();
      const int64_t dense_bytes = comm::payload_bytes_sent();
      comm::reset_collective_counts();
      comm::start_row_sparse_all_reduce(sparse, 48, 40000, op, comm::world()).wait();
      if (p > 1) {
        EXPECT_LT(comm::payload_bytes_sent(), dense_bytes) << "expected the sparse path";
      }
      EXPECT_TRUE(same_bits(sparse, dense))
          << "max abs diff " << (sparse.to(at::kDouble) - dense.to(at::kDouble)).abs().max();
      expect_equal_on_every_rank(sparse);
    }
  }
}

// The process's resident set, in bytes: its peak since the last reset (VmHWM) or now (VmRSS).
int64_t resident_bytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  return -1;
}

// The sum's extra memory is the rows received (and this rank's, sent): about one matrix over
// all ranks, not a zero-padded copy of the union per rank (P + 1 matrices here, where every
// row is some rank's). A 32 MiB matrix, every P-th row on each rank.
TEST(RowSparseAllReduce, SumsWithoutACopyOfTheUnionPerRank) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  if (p == 1) GTEST_SKIP() << "one rank exchanges nothing";
  constexpr int64_t kRows = 2048, kCols = 4096;
  auto sparse = input_of(r, kRows, kCols, p, 1, at::kFloat);
  const int64_t matrix_bytes = kRows * kCols * 4;
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5" << std::flush;  // VmHWM := VmRSS
  if (!clear) GTEST_SKIP() << "this kernel does not reset the peak (/proc/self/clear_refs)";
  const int64_t before = resident_bytes("VmRSS");
  ASSERT_GT(before, 0);
  ASSERT_LE(resident_bytes("VmHWM"), before + (8 << 20)) << "the peak was not reset";
  comm::reset_collective_counts();
  comm::start_row_sparse_all_reduce(sparse, kRows, kCols, comm::ReduceOp::kAvg, comm::world()).wait();
  ASSERT_LT(comm::payload_bytes_sent(), matrix_bytes) << "expected the sparse path";
  const int64_t peak = resident_bytes("VmHWM") - before;
  EXPECT_LT(peak, 2 * matrix_bytes) << "peak " << peak / (1 << 20) << " MiB over a "
                                    << matrix_bytes / (1 << 20) << " MiB matrix";
}

// 64 rows of 16 fp32 (64 bytes) and one flag, every 8th row on each rank: 8 rows each, and rank
// 0's row of -0.0 (its bits count). Each rank sends its count (8 bytes), its k indices (8 k
// bytes) and k rows and the flag ((16 k + 1) 4 bytes) to each of the P - 1 others. With every row on every
// rank, the dense all-reduce's bytes (2 (P - 1) / P of the 4100-byte buffer) after the counts.
TEST(RowSparseAllReduce, SendsOnlyTheRowsAnyRankHasOrTheDenseBytesWhereFewer) {
  const int64_t p = hp_test::world_size(), r = hp_test::rank();
  if (p == 1) GTEST_SKIP() << "one rank sends nothing";
  auto sparse = input_of(r, 64, 16, 8, 1, at::kFloat);
  comm::reset_collective_counts();
  comm::start_row_sparse_all_reduce(sparse, 64, 16, comm::ReduceOp::kAvg, comm::world()).wait();
  const int64_t k = r == 0 ? 9 : 8;
  EXPECT_EQ(comm::payload_bytes_sent(), (p - 1) * (8 + 8 * k + (16 * k + 1) * 4));
  EXPECT_EQ(comm::collective_count(comm::CollectiveKind::kAllReduce), 1);

  auto dense_rows = input_of(r, 64, 16, 1, 1, at::kFloat);
  auto reference = dense_rows.clone();
  comm::reset_collective_counts();
  comm::start_all_reduce(reference, comm::ReduceOp::kAvg, comm::world()).wait();
  const int64_t dense_bytes = comm::payload_bytes_sent();
  comm::reset_collective_counts();
  comm::start_row_sparse_all_reduce(dense_rows, 64, 16, comm::ReduceOp::kAvg, comm::world()).wait();
  EXPECT_EQ(comm::payload_bytes_sent(), (p - 1) * 8 + dense_bytes);
  EXPECT_TRUE(at::equal(dense_rows, reference));
}

// A buffer one element into its storage: the rows are read as words that tile that offset too.
TEST(RowSparseAllReduce, ABufferAtAnOffsetInItsStorage) {
  auto input = input_of(hp_test::rank(), 32, 64, 4, 1, at::kBFloat16);
  auto dense = input.clone();
  auto sparse = at::cat({at::zeros({1}, input.options()), input}).narrow(0, 1, input.numel());
  comm::start_all_reduce(dense, comm::ReduceOp::kAvg, comm::world()).wait();
  comm::start_row_sparse_all_reduce(sparse, 32, 64, comm::ReduceOp::kAvg, comm::world()).wait();
  EXPECT_TRUE(same_bits(sparse, dense));
}

TEST(RowSparseAllReduce, RefusesWhatItCannotReduce) {
  auto buffer = at::zeros({10});
  HP_EXPECT_THROW_MSG(comm::start_row_sparse_all_reduce(buffer, 4, 3, comm::ReduceOp::kSum, comm::world()),
                      "expected rows x cols within the 10 elements of the buffer, got 4 x 3");
  HP_EXPECT_THROW_MSG(comm::start_row_sparse_all_reduce(at::zeros({10}, at::kLong), 2, 5,
                                                        comm::ReduceOp::kSum, comm::world()),
                      "expected a floating-point tensor, got Long");
  HP_EXPECT_THROW_MSG(
      comm::start_row_sparse_all_reduce(buffer, int64_t{1} << 62, 4, comm::ReduceOp::kSum, comm::world()),
      "expected rows x cols within the 10 elements of the buffer");
  HP_EXPECT_THROW_MSG(
      comm::start_row_sparse_all_reduce(at::zeros({2, 5}), 2, 5, comm::ReduceOp::kSum, comm::world()),
      "expected a contiguous 1-D buffer, got sizes [2, 5]");
}

}  // namespace
