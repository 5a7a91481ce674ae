#pragma once
// The tensor-parallel plan for Llama 3 (torchtitan's): the only place that knows how the model
// is sharded.

#include <optional>

#include <torch/arg.h>

#include <hyper_parallel/core/dtensor/device_mesh.h>
#include <hyper_parallel/core/tensor_parallel/mc2_linear.h>

#include "model.h"

namespace llama3 {

/// Usage:
///   parallelize_llama3(*model, tp_mesh, ParallelizeOptions().seq_len(64));
struct ParallelizeOptions {
  /// Activations between blocks are sharded over the sequence (norms run on each rank's tokens;
  /// all-gather before attention / FFN, reduce-scatter after).
  TORCH_ARG(bool, enable_sequence_parallel) = true;
  /// Keep logits sharded over the vocabulary; train with vocab_parallel_cross_entropy.
  TORCH_ARG(bool, enable_loss_parallel) = false;
  /// MC2: the feed-forward's w1, w3 become MC2ColwiseParallel (input Shard(1), the fused op
  /// gathers) and w2 MC2RowwiseParallel (Shard(-1) -> Shard(1)); attention stays unfused.
  /// Requires sequence parallelism.
  TORCH_ARG(bool, enable_mc2) = false;
  /// The MC2 limits (default: the original kernels'; relaxed() for e.g. float32 debugging).
  TORCH_ARG(hyper_parallel::tensor_parallel::MC2Contract, mc2_contract) =
      hyper_parallel::tensor_parallel::MC2Contract::strict();
  TORCH_ARG(hyper_parallel::tensor_parallel::MC2Options, mc2_options) =
      hyper_parallel::tensor_parallel::MC2Options();
  /// The sequence length trained on (checked against the TP size); default: max_seq_len.
  TORCH_ARG(std::optional<int64_t>, seq_len) = std::nullopt;
};

/// Applies the plan on a 1-d TP mesh. Throws, naming the numbers, if n_heads, n_kv_heads or (with
/// sequence parallelism) seq_len is not divisible by the TP size.
void parallelize_llama3(TransformerImpl& model, const hyper_parallel::dtensor::DeviceMesh& tp_mesh,
                        const ParallelizeOptions& options = {});

}  // namespace llama3
