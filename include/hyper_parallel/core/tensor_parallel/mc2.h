#pragma once
// MC2 ("matmul + communication"): Linear layers under tensor + sequence parallelism whose
// collective and matmul overlap (docs/mc2.md). One room per concept, in mc2/:
//   contract.h         MC2Mode, the original kernels' limits (MC2Contract) and their shape table
//   ops.h              the fused ops all_gather_matmul and matmul_reduce_scatter, MC2Options
//   sequence_layout.h  an activation [..., S, ..., H] as sequence-major rows
//   fused_linear.h     the trainable fused Linear: forward and backward passes, and autograd
//   linear.h           MC2Linear, the handle on an nn::Linear that runs it
//   style.h            MC2ColwiseParallel and MC2RowwiseParallel
#include <hyper_parallel/core/tensor_parallel/mc2/contract.h>
#include <hyper_parallel/core/tensor_parallel/mc2/fused_linear.h>
#include <hyper_parallel/core/tensor_parallel/mc2/linear.h>
#include <hyper_parallel/core/tensor_parallel/mc2/ops.h>
#include <hyper_parallel/core/tensor_parallel/mc2/sequence_layout.h>
#include <hyper_parallel/core/tensor_parallel/mc2/style.h>
