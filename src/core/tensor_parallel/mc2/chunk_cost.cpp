#include <hyper_parallel/core/tensor_parallel/mc2/chunk_cost.h>

#include <algorithm>
#include <cmath>

#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/chunks.h>

namespace hyper_parallel::tensor_parallel {
namespace {

constexpr int64_t kMaxChunksPerRank = 16;
// Chunks of a multiple of this many rows start where a whole block's GEMM starts a row tile
// (BLAS libraries tile rows by a divisor of 32): each row is computed by the same kernel at any
// such count, so the results are bitwise those of one chunk.
constexpr int64_t kRowQuantum = 32;

// One rank's egress: messages leave one after another, each taking `per_message` seconds once
// it is posted, its bytes at the link's rate plus the link's latency. The latency counts as
// occupying the link: on a transport that runs on the CPU, as TCP does, most of it is per-message
// work on both ends, which does not overlap the next message's. Returns the arrival at the peer.
struct Egress {
  double per_message, busy_until = 0;
  double send(double posted) {
    busy_until = std::max(busy_until, posted) + per_message;
    return busy_until;
  }
};

// Ring all-gather: the own chunks leave at 0 and are multiplied first; received chunk k (step
// s = k / c + 1) is waited for, forwarded unless it is of the last step, then multiplied.
double ring_gather(int64_t p, int64_t c, double g, Egress link) {
  const int64_t received = (p - 1) * c;
  std::vector<double> arrival(received);
  for (int64_t j = 0; j < c && j < received; ++j) arrival[j] = link.send(0);
  double t = static_cast<double>(c) * g;
  for (int64_t k = 0; k < received; ++k) {
    t = std::max(t, arrival[k]);
    if (k + c < received) arrival[k + c] = link.send(t);  // the same send, a step later
    t += g;
  }
  return t;
}

// Ring reduce-scatter: at step s (0 <= s < p) each chunk's partial product is computed, then the
// partial sum that arrived for it is waited for and added, and the sum leaves (except at the
// last step, which is this rank's own block).
double ring_reduce(int64_t p, int64_t c, double g, Egress link) {
  std::vector<double> arrival(p * c, 0);
  double t = 0;
  for (int64_t s = 0; s < p; ++s) {
    for (int64_t j = 0; j < c; ++j) {
      t += g;
      if (s > 0) t = std::max(t, arrival[(s - 1) * c + j]);
      if (s + 1 < p) arrival[s * c + j] = link.send(t);
    }
  }
  return t;
}

// Direct reduce-scatter: the remote blocks' partials are computed and leave one by one, then
// this rank's own block; the op ends when its own partials are done and the others' have
// arrived (they leave the other ranks as this rank's leave it).
double direct_reduce(int64_t p, int64_t c, double g, Egress link) {
  double t = 0, last_arrival = 0;
  for (int64_t k = 0; k < (p - 1) * c; ++k) {
    t += g;
    last_arrival = link.send(t);
  }
  t += static_cast<double>(c) * g;
  return std::max(t, last_arrival);
}

}  // namespace

std::vector<int64_t> candidate_chunk_counts(int64_t rows_per_rank) {
  std::vector<int64_t> counts{1};
  for (int64_t c = 2; c <= kMaxChunksPerRank && c <= rows_per_rank; c *= 2) {
    if (comm::chunk_size(rows_per_rank, c, 0) % kRowQuantum == 0) counts.push_back(c);
  }
  return counts;
}

double predicted_seconds(FusedSchedule schedule, int64_t ranks, const ChunkCandidate& candidate,
                         const comm::LinkEstimate& link) {
  TORCH_CHECK_VALUE(ranks >= 1 && candidate.chunks >= 1,
                    "predicted_seconds: expected ranks >= 1 and chunks >= 1, got ", ranks, " and ",
                    candidate.chunks);
  TORCH_CHECK_VALUE(link.bytes_per_s > 0 && link.latency_s >= 0 && candidate.gemm_seconds >= 0 &&
                        candidate.chunk_bytes >= 0,
                    "predicted_seconds: expected a link rate > 0 and times and bytes >= 0, got rate ",
                    link.bytes_per_s, " B/s, latency ", link.latency_s, " s, GEMM ", candidate.gemm_seconds,
                    " s, ", candidate.chunk_bytes, " bytes");
  const int64_t c = candidate.chunks;
  const double g = candidate.gemm_seconds;
  if (ranks == 1) return static_cast<double>(c) * g;
  const bool infinite = std::isinf(link.bytes_per_s);
  const Egress egress{(infinite ? 0.0 : candidate.chunk_bytes / link.bytes_per_s) + link.latency_s};
  switch (schedule) {
    case FusedSchedule::kRingGather:
      return ring_gather(ranks, c, g, egress);
    case FusedSchedule::kRingReduce:
      return ring_reduce(ranks, c, g, egress);
    case FusedSchedule::kDirectReduce:
      return direct_reduce(ranks, c, g, egress);
  }
  TORCH_INTERNAL_ASSERT(false, "predicted_seconds: unknown schedule");
}

int64_t choose_chunks(FusedSchedule schedule, int64_t ranks, const std::vector<ChunkCandidate>& candidates,
                      const comm::LinkEstimate& link, double tolerance) {
  TORCH_CHECK_VALUE(!candidates.empty(), "choose_chunks: expected at least one candidate, got none");
  TORCH_CHECK_VALUE(tolerance >= 0, "choose_chunks: expected tolerance >= 0, got ", tolerance);
  std::vector<double> seconds;
  seconds.reserve(candidates.size());
  for (const auto& c : candidates) seconds.push_back(predicted_seconds(schedule, ranks, c, link));
  const double best = *std::min_element(seconds.begin(), seconds.end());
  int64_t chosen = -1;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (seconds[i] <= best * (1 + tolerance) && (chosen < 0 || candidates[i].chunks < chosen)) {
      chosen = candidates[i].chunks;
    }
  }
  return chosen;
}

}  // namespace hyper_parallel::tensor_parallel
