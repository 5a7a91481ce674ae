#pragma once
// The cost model behind MC2Options::chunks_per_rank = kAutoChunks: the time of one fused op's
// schedule (core/comm/schedule.h) for a candidate chunk count, played out step by step from two
// measured inputs, the GEMM time of one chunk and the link (comm/link_probe.h). All ranks run
// the same schedule, so one rank's timeline stands for all: the chunk a rank receives at a step
// left its neighbour when this rank's own send of that step left.
//
// Like the tile rule of Ascend's MC2 kernels, it splits only as far as it pays:
//   - a link much faster than the matmul: one chunk (nothing to hide, the largest GEMMs);
//   - otherwise: more chunks, as long as the head and tail they hide outweigh what smaller GEMMs
//     and more messages cost;
//   - at most 16 chunks per rank, each a multiple of 32 rows (candidate_chunk_counts).
// Unlike a closed-form rule, it reads the GEMM time of each chunk size, so a shape whose small
// GEMMs run slowly keeps its chunks large.

#include <cstdint>
#include <vector>

#include <hyper_parallel/core/comm/link_probe.h>

namespace hyper_parallel::tensor_parallel {

/// The schedule a fused op runs (schedule.h): all_gather_matmul the ring all-gather;
/// matmul_reduce_scatter the direct reduce-scatter for 16-bit inputs, the ring one otherwise.
enum class FusedSchedule { kRingGather, kRingReduce, kDirectReduce };

/// One candidate: `chunks` per rank, each chunk's GEMM taking `gemm_seconds` and its transfer
/// `chunk_bytes` on the wire.
struct ChunkCandidate {
  int64_t chunks = 1;
  double gemm_seconds = 0;
  double chunk_bytes = 0;
};

/// The chunk counts tried: 1, and those of 2, 4, 8 and 16 whose chunks (torch.chunk sizes) start
/// at multiples of 32 rows. Where the BLAS computes a row the same whatever rows come with it
/// (row tiles divide 32), the automatic choice, which depends on timings, never changes a bit of
/// the results; OpenBLAS's AVX-512 float32 kernels change last bits for any cut of the rows.
std::vector<int64_t> candidate_chunk_counts(int64_t rows_per_rank);

/// Predicted seconds of one op on `ranks` ranks (symmetric: every rank's timeline alike).
double predicted_seconds(FusedSchedule schedule, int64_t ranks, const ChunkCandidate& candidate,
                         const comm::LinkEstimate& link);

/// The candidate with the least predicted time; one within `tolerance` (relative) of it that
/// has fewer chunks wins instead: fewer, larger messages are the safer bet when the model cannot
/// tell them apart. Candidates must not be empty.
int64_t choose_chunks(FusedSchedule schedule, int64_t ranks, const std::vector<ChunkCandidate>& candidates,
                      const comm::LinkEstimate& link, double tolerance = 0.05);

}  // namespace hyper_parallel::tensor_parallel
