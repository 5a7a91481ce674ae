// The cost model behind chunks_per_rank = kAutoChunks, on synthetic timings: the schedules'
// predicted times in cases worked out by hand, and the choices they lead to.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include <c10/util/Exception.h>

#include <hyper_parallel/core/tensor_parallel/mc2/chunk_cost.h>

namespace tp = hyper_parallel::tensor_parallel;
using tp::FusedSchedule;

namespace {

constexpr double kBlockGemm = 1.0;  // seconds of one block's GEMM, the unit of these cases

// A link on which one block (`block_bytes`) takes `block_wire` seconds, and messages `latency`.
hyper_parallel::comm::LinkEstimate link(double block_wire, double latency = 0, double block_bytes = 1e6) {
  return {block_bytes / block_wire, latency};
}

// Candidates whose GEMMs scale with their rows plus `per_gemm` seconds each, and whose bytes are
// the block's share.
std::vector<tp::ChunkCandidate> candidates(double per_gemm = 0, double block_bytes = 1e6) {
  std::vector<tp::ChunkCandidate> out;
  for (int64_t c : tp::candidate_chunk_counts(1024)) {
    out.push_back({c, kBlockGemm / c + per_gemm, block_bytes / c});
  }
  return out;
}

double predicted(FusedSchedule s, int64_t ranks, int64_t chunks, double block_wire, double latency = 0) {
  return tp::predicted_seconds(s, ranks, {chunks, kBlockGemm / chunks, 1e6 / chunks},
                               link(block_wire, latency));
}

}  // namespace

TEST(ChunkCost, CandidatesArePowersOfTwoUpToSixteenInChunksOf32Rows) {
  EXPECT_EQ(tp::candidate_chunk_counts(0), (std::vector<int64_t>{1}));
  EXPECT_EQ(tp::candidate_chunk_counts(5), (std::vector<int64_t>{1}));
  EXPECT_EQ(tp::candidate_chunk_counts(64), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(tp::candidate_chunk_counts(1000), (std::vector<int64_t>{1}));  // 500 rows: not 32-aligned
  EXPECT_EQ(tp::candidate_chunk_counts(1024), (std::vector<int64_t>{1, 2, 4, 8, 16}));
  EXPECT_EQ(tp::candidate_chunk_counts(960), (std::vector<int64_t>{1, 2}));  // 480 rows, then 240
  EXPECT_EQ(tp::candidate_chunk_counts(250), (std::vector<int64_t>{1, 8}));  // 8 chunks of 32 and one of 26
}

TEST(ChunkCost, RingGatherByHand) {
  // 2 ranks, one chunk: the own block's GEMM, then the other block once it is here.
  EXPECT_DOUBLE_EQ(predicted(FusedSchedule::kRingGather, 2, 1, 0.5), 2.0);
  EXPECT_DOUBLE_EQ(predicted(FusedSchedule::kRingGather, 2, 1, 2.0), 3.0);
  // Four chunks of a link twice as slow as the GEMM: chunk j arrives at 0.5 (j + 1); the GEMMs
  // of the arrived chunks start at 1, 1.25, 1.5 and 2 and end at 2.25.
  EXPECT_DOUBLE_EQ(predicted(FusedSchedule::kRingGather, 2, 4, 2.0), 2.25);
  // 3 ranks: the second step's chunks were forwarded by the previous rank.
  EXPECT_DOUBLE_EQ(predicted(FusedSchedule::kRingGather, 3, 1, 2.0), 5.0);
  // One rank: the GEMMs only.
  EXPECT_DOUBLE_EQ(predicted(FusedSchedule::kRingGather, 1, 4, 2.0), 1.0);
}

TEST(ChunkCost, ReduceScattersByHand) {
  // Direct, 2 ranks, one chunk: the remote partial leaves after its GEMM and arrives a block's
  // wire time later, while the own partial is computed.
  EXPECT_DOUBLE_EQ(predicted(FusedSchedule::kDirectReduce, 2, 1, 0.5), 2.0);
  EXPECT_DOUBLE_EQ(predicted(FusedSchedule::kDirectReduce, 2, 1, 3.0), 4.0);
  EXPECT_DOUBLE_EQ(predicted(FusedSchedule::kDirectReduce, 2, 4, 3.0), 3.25);
  // Ring, 2 ranks, one chunk: partial, send; own partial, wait for the arrived sum, done.
  EXPECT_DOUBLE_EQ(predicted(FusedSchedule::kRingReduce, 2, 1, 3.0), 4.0);
  EXPECT_DOUBLE_EQ(predicted(FusedSchedule::kRingReduce, 2, 1, 0.5), 2.0);
}

TEST(ChunkCost, MessageLatencyAddsToEveryArrival) {
  EXPECT_DOUBLE_EQ(predicted(FusedSchedule::kDirectReduce, 2, 1, 3.0, 0.25), 4.25);
  EXPECT_DOUBLE_EQ(predicted(FusedSchedule::kRingGather, 2, 1, 2.0, 0.25), 3.25);
}

TEST(ChunkCost, ChoosesOneChunkWhenTheLinkIsFarFaster) {
  for (auto s : {FusedSchedule::kRingGather, FusedSchedule::kRingReduce, FusedSchedule::kDirectReduce}) {
    EXPECT_EQ(tp::choose_chunks(s, 2, candidates(), link(0.01)), 1);
    EXPECT_EQ(tp::choose_chunks(s, 4, candidates(), link(0.01)), 1);
    // No link at all (one rank's estimate).
    EXPECT_EQ(tp::choose_chunks(s, 1, candidates(), {std::numeric_limits<double>::infinity(), 0}), 1);
  }
}

TEST(ChunkCost, SplitsAsFarAsItPays) {
  // A slow link and GEMMs that scale perfectly: the finest split hides the most (2.0625 against
  // 8 chunks' 2.125), but by less than the default tolerance of 5%, so 8 wins.
  EXPECT_EQ(tp::choose_chunks(FusedSchedule::kRingGather, 2, candidates(), link(2.0), 0.0), 16);
  EXPECT_EQ(tp::choose_chunks(FusedSchedule::kRingGather, 2, candidates(), link(2.0)), 8);
  EXPECT_EQ(tp::choose_chunks(FusedSchedule::kDirectReduce, 2, candidates(), link(2.0)), 8);
  // Each GEMM costs a fixed 0.05 s more: past a few chunks the overhead outweighs the head.
  const auto with_overhead = candidates(0.05);
  const int64_t chosen = tp::choose_chunks(FusedSchedule::kDirectReduce, 2, with_overhead, link(2.0));
  EXPECT_GT(chosen, 1);
  EXPECT_LT(chosen, 16);
  // Latency per message does the same.
  const int64_t with_latency = tp::choose_chunks(FusedSchedule::kRingGather, 2, candidates(), link(2.0, 0.1));
  EXPECT_LT(with_latency, 16);
}

TEST(ChunkCost, NearTiesGoToFewerChunks) {
  // 2 ranks, a link as fast as the GEMM: the own block hides the transfer whatever the count.
  EXPECT_EQ(tp::choose_chunks(FusedSchedule::kRingGather, 2, candidates(), link(1.0)), 1);
  // A count 4% slower than the best but with fewer chunks wins at the default tolerance, not at 0.
  std::vector<tp::ChunkCandidate> two{{1, 1.04, 0}, {2, 0.5, 0}};
  EXPECT_EQ(tp::choose_chunks(FusedSchedule::kRingGather, 1, two, link(1.0)), 1);
  EXPECT_EQ(tp::choose_chunks(FusedSchedule::kRingGather, 1, two, link(1.0), 0.0), 2);
}

TEST(ChunkCost, ErrorsNameWhatWasExpected) {
  EXPECT_THROW(tp::choose_chunks(FusedSchedule::kRingGather, 2, {}, link(1.0)), c10::ValueError);
  EXPECT_THROW(tp::predicted_seconds(FusedSchedule::kRingGather, 0, {1, 1, 1}, link(1.0)), c10::ValueError);
  EXPECT_THROW(tp::choose_chunks(FusedSchedule::kRingGather, 2, candidates(), link(1.0), -0.1),
               c10::ValueError);
  // A default LinkEstimate has no rate: an error, not a NaN prediction.
  EXPECT_THROW(tp::predicted_seconds(FusedSchedule::kRingGather, 2, {1, 1, 0}, {}), c10::ValueError);
  EXPECT_THROW(tp::choose_chunks(FusedSchedule::kDirectReduce, 2, candidates(), {}), c10::ValueError);
}
