#pragma once
// The tensor-parallel plan for Llama 3 (torchtitan's): the only place that knows how the model
// is sharded.

#include <optional>
#include <string>

#include <torch/arg.h>

#include <hyper_parallel/core/dtensor/device_mesh.h>
#include <hyper_parallel/core/tensor_parallel/mc2/contract.h>
#include <hyper_parallel/core/tensor_parallel/mc2/ops.h>

#include "model.h"

namespace llama3 {

/// Which layers MC2 fuses, with enable_mc2.
enum class MC2Scope {
  /// The feed-forward's w1, w3 (column) and w2 (row): the original system's scope.
  kFfn,
  /// Also the attention's wq, wk, wv (column, one shared gather) and wo (row), and, with loss
  /// parallel, the output projection (column). The attention core and the embedding stay
  /// unfused. This project's addition, chosen explicitly.
  kAll,
};
/// "ffn" or "all"; anything else is an error naming the value.
MC2Scope mc2_scope_from_string(const std::string& scope);
const char* to_string(MC2Scope scope);

/// Usage:
///   parallelize_llama3(*model, tp_mesh, ParallelizeOptions().seq_len(64));
///   parallelize_llama3(*model, tp_mesh, ParallelizeOptions().enable_mc2(true).mc2_scope(MC2Scope::kAll));
struct ParallelizeOptions {
  /// Activations between blocks are sharded over the sequence (norms run on each rank's tokens;
  /// all-gather before attention / FFN, reduce-scatter after).
  TORCH_ARG(bool, enable_sequence_parallel) = true;
  /// Keep logits sharded over the vocabulary; train with vocab_parallel_cross_entropy.
  TORCH_ARG(bool, enable_loss_parallel) = false;
  /// MC2: the column layers in mc2_scope become MC2ColwiseParallel (input Shard(1), the fused op
  /// gathers) and the row layers MC2RowwiseParallel (Shard(-1) -> Shard(1)). Requires sequence
  /// parallelism.
  TORCH_ARG(bool, enable_mc2) = false;
  /// The layers MC2 fuses (only with enable_mc2): default the feed-forward.
  TORCH_ARG(MC2Scope, mc2_scope) = MC2Scope::kFfn;
  /// The MC2 limits (default: the original kernels'; relaxed() for e.g. float32 debugging).
  TORCH_ARG(hyper_parallel::tensor_parallel::MC2Contract,
            mc2_contract) = hyper_parallel::tensor_parallel::MC2Contract::strict();
  TORCH_ARG(hyper_parallel::tensor_parallel::MC2Options,
            mc2_options) = hyper_parallel::tensor_parallel::MC2Options();
  /// The sequence length trained on (checked against the TP size); default: max_seq_len.
  TORCH_ARG(std::optional<int64_t>, seq_len) = std::nullopt;
};

/// Applies the plan on a 1-d TP mesh. Throws, naming the numbers, if n_heads, n_kv_heads or (with
/// sequence parallelism) seq_len is not divisible by the TP size.
void parallelize_llama3(TransformerImpl& model, const hyper_parallel::dtensor::DeviceMesh& tp_mesh,
                        const ParallelizeOptions& options = {});

}  // namespace llama3
