#pragma once
// Loss parallel: cross-entropy (fused, or log_softmax then nll_loss) over vocabulary-sharded
// logits; the logits are never gathered.

#include <optional>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/dtensor/device_mesh.h>
#include <hyper_parallel/core/dtensor/dtensor.h>

#include <torch/arg.h>

namespace hyper_parallel::tensor_parallel {

/// How the per-token losses combine, as torch's `reduction`.
enum class LossReduction { kNone, kMean, kSum };

/// torch.nn.functional.cross_entropy's options that the vocabulary-parallel loss takes.
///
/// Usage:
///   vocab_parallel_cross_entropy(logits, targets, vocab, mesh,
///                                CrossEntropyOptions().ignore_index(-100).label_smoothing(0.1))
struct CrossEntropyOptions {
  /// Targets equal to it add no loss and no gradient; the mean is over the others (NaN if none).
  TORCH_ARG(int64_t, ignore_index) = -100;
  TORCH_ARG(LossReduction, reduction) = LossReduction::kMean;
  /// In [0, 1]: the target is (1 - s) on its class and s / vocab_size on every class.
  TORCH_ARG(double, label_smoothing) = 0.0;
};

/// Cross-entropy of `local_logits` [..., V_local] (this rank's Shard(-1) chunk of the vocabulary,
/// torch.chunk sizes of `vocab_size`) against `targets` [...] (global ids, the same on every rank,
/// in [0, vocab_size) or options.ignore_index: anything else is a c10::ValueError; int64 only, as
/// torch's: another integer dtype is a c10::TypeError on every rank, before any collective). Equals
/// cross_entropy(full_logits, targets, ...) with the options, computed in float32 for 16-bit logits
/// and in their own dtype otherwise; differentiable. Communication, all of [...]-sized tensors: one
/// all-gather (the max) and two all-reduces (sum of exponentials, target logit), a third with label
/// smoothing (sum of the logits); none in backward. A backward with create_graph (a gradient
/// penalty) is a c10::NotImplementedError, as through every op whose backward this library
/// computes outside autograd.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                        int64_t vocab_size, const dtensor::DeviceMesh& mesh,
                                        const CrossEntropyOptions& options = {});

/// log_softmax(full_logits, -1) over vocabulary-sharded logits: `local_logits` [..., V_local] is
/// this rank's chunk (as vocab_parallel_cross_entropy's), the result this rank's chunk of the
/// log-probabilities, as a DTensor sharded on its last dim, in the logits' dtype (computed in
/// float32 for 16-bit logits); differentiable. Communication, of [...]-sized tensors: one
/// all-gather (the max) and one all-reduce (sum of exponentials); in backward one all-reduce (the
/// gradient's sum over the vocabulary), so every rank of the mesh runs the backward. With
/// vocab_parallel_nll_loss it is torch's unfused cross-entropy, nll_loss(log_softmax(x, -1)).
dtensor::DTensor vocab_parallel_log_softmax(const at::Tensor& local_logits, int64_t vocab_size,
                                            const dtensor::DeviceMesh& mesh);

/// nll_loss(full_input, targets) over a vocabulary-sharded input (log-probabilities, e.g.
/// vocab_parallel_log_softmax's chunk): -input[target] per token, where the rank holding that
/// entry reads it; targets as vocab_parallel_cross_entropy's (int64 ids or ignore_index), the
/// mean over the kept ones. Computed and returned in float32 for 16-bit input, as the
/// cross-entropy; differentiable. One all-reduce of [...] (the target's entry); none in backward.
at::Tensor vocab_parallel_nll_loss(const at::Tensor& local_input, const at::Tensor& targets,
                                   int64_t vocab_size, const dtensor::DeviceMesh& mesh,
                                   LossReduction reduction = LossReduction::kMean,
                                   int64_t ignore_index = -100);

/// For `t`, a tensor no autograd graph traces back (an eval loss under no_grad:
/// `pred.flatten(0, 1).float()`; a detached copy): the vocabulary-sharded logits (Shard(-1) on a
/// 1-d mesh) among DTensor::recent_last_dim_shards() whose local shard t holds, its elements in
/// order after a cast, on every rank of their mesh (one all-reduce of a flag agrees). nullopt if t
/// is as wide as no rank's shard of any such logits: it is not theirs. Otherwise a c10::ValueError
/// on every rank, as t may have been computed from a shard by something else (a scale, a shift, a
/// concatenation) that, read as whole logits, gives each rank its own loss: t does not hold its
/// shard on some rank, or the logits it may come from are gone. A c10::NotImplementedError, on every
/// rank, where t's graph reaches leaves alone and one of another size than t on some rank
/// (`pred.detach() / learnable_temperature`): computed beside this rank's shard, that leaf's
/// gradient would be this rank's part only.
/// Collective over the logits' mesh when some are alive: every rank calls it with a tensor of its
/// own shard's sizes, as it would the loss. The ranks decide from their own shards' sizes and from
/// which logits are alive on them; where these differ (logits kept on one rank only; a freed
/// logits of one vocabulary beside live ones of another, split unevenly) a rank may wait in the
/// agreement until the group's timeout.
std::optional<dtensor::DTensor> untraced_vocab_shard_source(const at::Tensor& t);

/// The same judged on this rank alone, without communication: the live vocabulary-sharded logits
/// whose local shard `t` holds (its elements in order after a cast), else nullopt, never an
/// error. For an op that is collective only when its input is such logits (a log_softmax inside
/// loss_parallel), so that a tensor that is not (a log_softmax for logging, on one rank) costs no
/// communication.
std::optional<dtensor::DTensor> local_vocab_shard_source(const at::Tensor& t);

}  // namespace hyper_parallel::tensor_parallel
