#pragma once
// Training loop for the Llama 3 example: deterministic synthetic tokens, AdamW, gradient clipping.
// Weights are initialised identically whatever the TP degree (full tensors from the seed on every
// rank, then sharded), so TP=1 and TP=N runs are comparable step by step.

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <torch/arg.h>

#include "model.h"

namespace llama3 {

struct TrainOptions {
  TORCH_ARG(std::string, preset) = "debug";
  /// A model that is not a preset (overrides `preset`).
  TORCH_ARG(std::optional<ModelArgs>, model_args) = std::nullopt;
  TORCH_ARG(int64_t, steps) = 20;
  /// The global batch: with dp > 1 each data-parallel replica runs batch_size / dp of its rows.
  TORCH_ARG(int64_t, batch_size) = 4;
  /// Data-parallel replicas (TP = world size / dp): a {dp, tp} mesh, the plan on mesh["tp"],
  /// gradients averaged over mesh["dp"] during the backward (data_parallel).
  TORCH_ARG(int64_t, dp) = 1;
  /// Shard the dp dim with fully_shard (FSDP: parameters, gradients and AdamW state sharded;
  /// each block, then the root) instead of replicating it with data_parallel.
  TORCH_ARG(bool, fully_shard) = false;
  /// With fully_shard: HSDP with this many replicas of dp / hsdp_replicate shards each, on a
  /// {replicate, shard, tp} mesh (gradients reduce-scattered over shard, all-reduced over
  /// replicate).
  TORCH_ARG(int64_t, hsdp_replicate) = 1;
  /// With fully_shard: free the gathered parameters after each block's forward (gathered again
  /// for its backward); false keeps them to the end of the backward.
  TORCH_ARG(bool, reshard_after_forward) = true;
  TORCH_ARG(std::optional<int64_t>, seq_len) = std::nullopt;  // default: the preset's max_seq_len
  TORCH_ARG(std::string, dtype) = "fp32";                     // "fp32" or "bf16"
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, weight_decay) = 0.1;
  TORCH_ARG(double, max_norm) = 1.0;
  TORCH_ARG(uint64_t, seed) = 42;
  TORCH_ARG(bool, enable_sequence_parallel) = true;
  TORCH_ARG(bool, enable_loss_parallel) = false;
  TORCH_ARG(bool, enable_mc2) = false;
  /// Which layers MC2 fuses: "ffn" (the feed-forward) or "all" (also attention projections and,
  /// with loss parallel, the output projection).
  TORCH_ARG(std::string, mc2_scope) = "ffn";
  /// MC2 limits; strict (bf16/fp16 only) unless relaxed for debugging.
  TORCH_ARG(bool, relaxed_mc2_contract) = false;
  /// MC2Options::chunks_per_rank: kAutoChunks (0), or a fixed count.
  TORCH_ARG(int64_t, mc2_chunks_per_rank) = 0;
  TORCH_ARG(bool, log) = true;  // one line per step on rank 0
  /// Single-process reference: the same model and data, not parallelized, no communication.
  TORCH_ARG(bool, reference) = false;
  /// Checkpoint root (hyper_parallel::checkpoint): step-N directories and `latest`; empty: none.
  TORCH_ARG(std::string, checkpoint_dir) = "";
  /// Save the model and AdamW's state every N steps and at the last step; 0: never.
  TORCH_ARG(int64_t, checkpoint_every) = 0;
  /// Require a checkpoint in checkpoint_dir. Whenever checkpoint_dir holds one (its `latest`),
  /// training continues from it (saved at any TP degree): the model, AdamW's state and the step
  /// counter are restored, so steps latest+1 .. steps run as they would have without the
  /// interruption (the data depends only on seed and step). A restarted job continues by itself.
  TORCH_ARG(bool, resume) = false;
  /// Save asynchronously (checkpoint::SaveOptions::asynchronous): the step loop stalls only for
  /// a copy of the rank's share of the state; the files are written while training goes on.
  TORCH_ARG(bool, async_checkpoint) = false;
};

struct StepResult {
  int64_t step;
  double loss;
  double grad_norm;
  double ms;
  double tokens_per_s;
};

/// Trains on a 1-d TP mesh over the whole world (TP = world size), or with dp > 1 on a {dp, tp}
/// mesh (losses and gradient norms are the global batch's). Calls `inspect` (if set) after
/// each backward, before the optimizer step, e.g. to compare gradients. Returns the steps this
/// call ran (after a checkpoint: latest+1 .. steps). At every step boundary the ranks agree on
/// whether one was asked to stop (comm::agree_on_preemption: hp-run's SIGUSR1); if so they save a
/// checkpoint of that step (with checkpoint_dir), print "hp-preempted: checkpoint at step N" and
/// return early. HP_FAULT_KILL_AT_STEP kills a rank at a step (comm::maybe_kill_at_step).
std::vector<StepResult> train(const TrainOptions& options,
                              const std::function<void(int64_t step, TransformerImpl&)>& inspect = {});

/// Batch `step` of the synthetic data: sequences following t_{i+1} = (5 t_i + 3) mod vocab from
/// a start token drawn from (seed, step, row), so the model can learn it and the loss falls.
at::Tensor synthetic_batch(uint64_t seed, int64_t step, int64_t batch_size, int64_t seq_len,
                           int64_t vocab_size);

}  // namespace llama3
