#pragma once
// Internal, for benchmarks (with comm/test_hooks.h, the library's test and bench hooks): the
// schedules of all_gather_matmul / matmul_reduce_scatter with no-op callbacks. The same
// transfers, chunks, accumulate dtype and order, matmuls left out, so timing them gives the
// communication the fused op has to hide. Results are meaningless; not counted as collectives.
// Collective: all ranks of `group` call in the same order, with the fused op's operands.

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/tensor_parallel/mc2/ops.h>

namespace hyper_parallel::tensor_parallel::detail {

void all_gather_matmul_transfers_only(const at::Tensor& x, const at::Tensor& w, const comm::Group& group,
                                      const MC2Options& options = {});
void matmul_reduce_scatter_transfers_only(const at::Tensor& x, const at::Tensor& w, const comm::Group& group,
                                          const MC2Options& options = {});

}  // namespace hyper_parallel::tensor_parallel::detail
