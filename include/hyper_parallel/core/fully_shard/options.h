#pragma once
// fully_shard's options: the data-parallel mesh, when parameters are resharded, mixed precision
// and offloading, as PyTorch FSDP2 and HyperParallel's fully_shard name them.

#include <cstdint>
#include <optional>

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <hyper_parallel/core/dtensor/device_mesh.h>

namespace hyper_parallel::fully_shard {

/// The dtypes a module's forward and gradient reduction run in, applied per module.
///
/// Usage:
///   MixedPrecisionPolicy().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat)
struct MixedPrecisionPolicy {
  /// The gathered parameters' dtype (the shards keep theirs: the optimizer's master copy).
  /// nullopt: the parameters' own.
  TORCH_ARG(std::optional<at::ScalarType>, param_dtype) = std::nullopt;
  /// The gradient reduce-scatter's (and HSDP all-reduce's) dtype; nullopt: the gradients' own.
  TORCH_ARG(std::optional<at::ScalarType>, reduce_dtype) = std::nullopt;
  /// Floating inputs of a managed module are cast to param_dtype (when it is set).
  TORCH_ARG(bool, cast_forward_inputs) = true;
  /// Each shard's reduced gradient goes to its main gradient (nn/main_grad.h), in the
  /// reduce dtype, instead of .grad (cast to the shard's dtype).
  TORCH_ARG(bool, apply_grad_on_fp32_main_grad) = false;
};

/// Where the sharded parameters live between steps. On a CPU-only build they are on the CPU
/// already, so offloading is what happens anyway; pinned memory needs an accelerator.
struct OffloadPolicy {
  TORCH_ARG(bool, offload_to_cpu) = false;
  /// Pinned host memory for faster host-to-device copies: not available without an
  /// accelerator (fully_shard refuses it rather than ignoring it).
  TORCH_ARG(bool, pin_memory) = false;
};

/// Usage:
///   auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
///   fully_shard(*block, FullyShardOptions().mesh(mesh["dp"]));
///   fully_shard(*model, FullyShardOptions().mesh(mesh["dp"]).reshard_after_forward(false));
/// HSDP: a 2-d (replicate, shard) mesh, e.g. mesh[{"replicate", "shard"}].
struct FullyShardOptions {
  /// 1-d: parameters sharded over it. 2-d: dim 0 replicates, dim 1 shards (HSDP): gradients are
  /// reduce-scattered over dim 1, then all-reduced over dim 0. nullopt: 1-d over the world.
  TORCH_ARG(std::optional<dtensor::DeviceMesh>, mesh) = std::nullopt;
  /// Free the gathered parameters after the forward and gather them again for the backward
  /// (ZeRO-3); false keeps them from the forward to the end of the backward (ZeRO-2-like).
  TORCH_ARG(bool, reshard_after_forward) = true;
  TORCH_ARG(MixedPrecisionPolicy, mp_policy) = {};
  TORCH_ARG(OffloadPolicy, offload_policy) = {};
  /// A group whose one parameter is an Embedding's weight reduce-scatters only the gradient rows
  /// of the tokens some rank saw (bitwise the dense result, fewer bytes; the dense exchange when
  /// it would send less). false: always dense.
  TORCH_ARG(bool, row_sparse_embeddings) = true;
  /// A group's gradients reduce-scatter in buckets as autograd produces them: a bucket starts
  /// once the gradients ready and not yet sent reach this many bytes (as the reduce-scatter's
  /// input), and the last one when the group's backward is over, so most of a group's gradients
  /// travel while its own backward goes on. 0: one reduce-scatter per group, after its whole
  /// backward (what Python's comm_fusion=True asks for). Bitwise the same gradients either way.
  TORCH_ARG(int64_t, reduce_bucket_cap_bytes) = int64_t{4} << 20;
};

}  // namespace hyper_parallel::fully_shard
