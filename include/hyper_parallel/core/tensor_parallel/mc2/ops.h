#pragma once
// MC2 fused ops ("matmul + communication") on 2-d local views, W in Linear's (out, in) layout.
// Each is a schedule of the engine in core/comm/schedule.h whose per-chunk callback is a matmul:
// while one chunk of the sequence is in flight, the matmul of an arrived chunk runs on the
// calling thread (transfers progress in the transport's threads). docs/mc2.md states the
// contract.
//
//   all_gather_matmul      (column-parallel)  equals  G = all_gather(X, rows); Y = G Wᵀ
//   matmul_reduce_scatter  (row-parallel)     equals  Y = reduce_scatter(X Wᵀ, rows, sum)
//
// Who waits on whom:
//   - all_gather_matmul (ring all-gather): the calling thread waits for a chunk's arrival only
//     right before it multiplies that chunk;
//   - matmul_reduce_scatter, float32/float64 (ring reduce-scatter): it computes a chunk's partial
//     product, then waits for the partial sum arriving from the previous rank and adds to it;
//   - matmul_reduce_scatter, bfloat16/float16 (direct reduce-scatter): it computes each remote
//     block's partial and hands it to the transport at once, 16 bits on the wire; it waits for
//     the other ranks' partials of its own block only after computing its own, then sums them in
//     float32 in rank order;
// and every op waits for its own sends before it returns.
//
// Contract: all ranks of the group call the same op, in the same order, with the same dtype and
// chunks_per_rank (each a fixed count, or each kAutoChunks), and the same extents that travel (m and k of the
// gather; the rows and n of the reduce-scatter). The extent that stays local may differ (uneven weight
// shards).

#include <cstdint>
#include <utility>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <hyper_parallel/core/comm/op.h>
#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/comm/schedule.h>

namespace hyper_parallel::tensor_parallel {

/// The fused ops' kinds, counted, traced and agreed on as one collective each (comm/op.h), e.g.
/// comm::collective_count(kAllGatherMatmulKind, "forward").
inline constexpr comm::CollectiveKind kAllGatherMatmulKind{"all_gather_matmul"};
inline constexpr comm::CollectiveKind kMatmulReduceScatterKind{"matmul_reduce_scatter"};

/// How the fused ops cut each rank's block of rows. Usage: MC2Options().chunks_per_rank(4)
struct MC2Options {
  /// chunks_per_rank: chosen per op by the cost model of chunk_cost.h.
  static constexpr int64_t kAutoChunks = 0;
  /// Throws ValueError naming `fn` unless `chunks` is a valid chunks_per_rank (>= 1, or kAutoChunks).
  static void check_chunks_per_rank(const char* fn, int64_t chunks);
  /// Each rank's block of rows travels and is multiplied as this many chunks (torch.chunk
  /// sizes): more chunks pipeline finer (the first matmul starts sooner, the last transfer
  /// hides behind more work) but run smaller GEMMs and send more messages. kAutoChunks (the
  /// default): each op's count comes from a cost model of its schedule, fed with this rank's
  /// GEMM time per chunk size (measured once per shape) and the group's link (measured by the
  /// group's first such op); the ranks take rank 0's choice. A fixed count makes the schedule,
  /// and with it every transfer, the same from run to run and machine to machine.
  TORCH_ARG(int64_t, chunks_per_rank) = kAutoChunks;
  /// The weight gradients that cannot hide behind their own collective (a row Linear's, which
  /// needs the whole gather of dY, and those of layers sharing another layer's gather) are
  /// computed in the next backward gather's window instead: a row Linear's, or a reduce-scatter
  /// redistribute's such as the embedding's (mc2_row_linear, mc2_shared_column_linear;
  /// docs/mc2.md). Bitwise the same gradients; dY and the saved input
  /// live until that window. Off: each is computed in its own backward node, as soon as it can.
  TORCH_ARG(bool, defer_weight_grads) = true;
};

/// (Y, G) with G = all_gather(x [m, k], rows) of shape [P·m, k] and Y = G Wᵀ [P·m, n]. Every rank
/// passes the same m. Step s multiplies the chunks that arrived at step s-1 while forwarding them.
std::pair<at::Tensor, at::Tensor> all_gather_matmul(const at::Tensor& x, const at::Tensor& w,
                                                    const comm::Group& group, const MC2Options& options = {});
/// reduce_scatter(x [M, k_l] Wᵀ, rows, sum) of shape [M/P, n]; M divisible by P. Step s computes
/// the partial product of one destination block while the partial sum for it is in flight;
/// 16-bit inputs accumulate across ranks in float32 and round once.
at::Tensor matmul_reduce_scatter(const at::Tensor& x, const at::Tensor& w, const comm::Group& group,
                                 const MC2Options& options = {});

/// The same schedules with an explicit right operand: all_gather(a) @ b, and
/// reduce_scatter(a @ b + addend) (addend [M, n], optional, added to each rank's partial before
/// the reduction). The backward passes use these (b = W instead of Wᵀ); `while_in_flight` runs
/// once, on the calling thread, while transfers travel: the reduce-scatter's partials (the
/// column backward's weight gradient) or the gather's last chunks (the weight gradients
/// deferred into a row backward's window).
std::pair<at::Tensor, at::Tensor> all_gather_mm(const at::Tensor& a, const at::Tensor& b,
                                                const comm::Group& group, const MC2Options& options = {},
                                                const comm::InFlightFn& while_in_flight = {});
at::Tensor mm_reduce_scatter(const at::Tensor& a, const at::Tensor& b, const comm::Group& group,
                             const MC2Options& options = {}, const at::Tensor& addend = {},
                             const comm::InFlightFn& while_in_flight = {});

namespace detail {
/// a @ b on a's device, traced as a matmul span; 16-bit CPU operands accumulate in float32
/// (nn::mm).
at::Tensor local_matmul(const at::Tensor& a, const at::Tensor& b);
}  // namespace detail

}  // namespace hyper_parallel::tensor_parallel
