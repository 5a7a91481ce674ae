#pragma once
// Loss parallel: cross-entropy over vocabulary-sharded logits; the logits are never gathered.

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/dtensor/device_mesh.h>

namespace hyper_parallel::tensor_parallel {

/// Mean cross-entropy of `local_logits` [..., V_local] (this rank's Shard(-1) chunk of the
/// vocabulary, torch.chunk sizes of `vocab_size`) against `targets` [...] (global ids, the same on
/// every rank, in [0, vocab_size): anything else is a c10::ValueError). Equals
/// cross_entropy(full_logits, targets), computed in float32 for 16-bit logits and in their own
/// dtype otherwise; differentiable. Communication, all of
/// [...]-sized tensors: one all-gather (the max) and two all-reduces (sum of exponentials, target
/// logit); none in backward.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                        int64_t vocab_size, const dtensor::DeviceMesh& mesh);

}  // namespace hyper_parallel::tensor_parallel
