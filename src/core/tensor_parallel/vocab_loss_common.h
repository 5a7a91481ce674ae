#pragma once
// Internal: what the vocabulary-parallel ops (cross-entropy, log_softmax, nll_loss) share: their
// class-index targets, checked on every rank before any collective; the reductions over tokens;
// the logits shifted by their global row maximum.

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/dtensor/device_mesh.h>
#include <hyper_parallel/core/tensor_parallel/loss_parallel.h>

#include "style_common.h"

namespace hyper_parallel::tensor_parallel::detail {

struct LossTargets {
  at::Tensor ignored, kept, kept_count;  // per token; kept_count: the targets not ignored
  VocabShard shard;                      // where each kept target's entry lives (ignored: class 0)
};

/// `targets` [...] against this rank's `local` [..., V_local] chunk of a `vocab_size` vocabulary:
/// int64 class indices (floating ones: c10::NotImplementedError; other dtypes: c10::TypeError), of
/// local's leading shape, in [0, vocab_size) or ignore_index (else c10::ValueError). `fn` names
/// the caller in the messages. Local: every rank raises the same error from the same targets.
LossTargets loss_targets(const char* fn, const at::Tensor& local, const at::Tensor& targets,
                         int64_t vocab_size, const dtensor::DeviceMesh& mesh, int64_t ignore_index);

/// The per-token losses (0 where ignored) reduced as `reduction`: the mean is over the kept
/// targets (NaN if none, as torch's).
at::Tensor reduce_loss(const at::Tensor& per_token, const at::Tensor& kept_count, LossReduction reduction);

/// The gradient each token's loss gets from the reduced loss's gradient `grad`; 0 where ignored.
at::Tensor row_scale(const at::Tensor& grad, const at::Tensor& kept, const at::Tensor& kept_count,
                     LossReduction reduction);

/// `logits` [..., V_local] (in a floating dtype) minus each row's maximum over the whole vocabulary
/// (one all-gather of the row maxima over `group`; a rank with an empty chunk adds -inf).
/// Collective: every rank of the group calls it with the same leading shape.
at::Tensor shifted_by_global_max(const at::Tensor& logits, const comm::Group& group);

/// `gradient` laid out as `input` (a copy only where its strides differ): torch 1.13 has kernels
/// that misread a gradient of other strides than its input's.
at::Tensor laid_out_as(const at::Tensor& gradient, const at::Tensor& input);

}  // namespace hyper_parallel::tensor_parallel::detail
