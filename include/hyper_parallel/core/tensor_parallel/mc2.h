#pragma once
// MC2 ("matmul + communication"): Linear layers under tensor + sequence parallelism whose
// collective and matmul overlap (docs/mc2.md).
//   mc2_ops.h     the fused ops all_gather_matmul and matmul_reduce_scatter, and their options
//   mc2_linear.h  the contract's limits, the trainable fused Linear and MC2Linear
//   mc2_style.h   MC2ColwiseParallel and MC2RowwiseParallel
#include <hyper_parallel/core/tensor_parallel/mc2_linear.h>
#include <hyper_parallel/core/tensor_parallel/mc2_ops.h>
