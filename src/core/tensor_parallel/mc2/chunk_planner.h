#pragma once
// Internal: the chunk count this rank proposes for one fused op. A fixed
// MC2Options::chunks_per_rank is proposed as it is; kAutoChunks runs the cost model
// (chunk_cost.h) on this rank's GEMM time for each candidate chunk size, measured on the op's own
// operands the first time a shape is seen and kept for the process, and on the group's link
// (link_probe.h; the group's first automatic op measures it). The ranks then settle on rank 0's
// proposal in the op's agreement (OpScope), so a rank whose timings differ cannot split the group.

#include <cstdint>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/tensor_parallel/mc2/chunk_cost.h>
#include <hyper_parallel/core/tensor_parallel/mc2/ops.h>

namespace hyper_parallel::tensor_parallel::detail {

/// This rank's proposal for all_gather_mm(a [m, k], b [k, n]) and mm_reduce_scatter(a [P m, k_l],
/// b [k_l, n]) (contiguous a): a fixed count as it is (checked once the ranks agreed, so a bad
/// count on one rank is the agreement error on all), or auto's. Collective only when it measures
/// the group's link (link_probe.h).
int64_t all_gather_mm_chunks(const at::Tensor& a, const at::Tensor& b, const comm::Group& group,
                             const MC2Options& options);
int64_t mm_reduce_scatter_chunks(const at::Tensor& a, const at::Tensor& b, const comm::Group& group,
                                 const MC2Options& options);

}  // namespace hyper_parallel::tensor_parallel::detail
