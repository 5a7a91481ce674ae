#include "vocab_loss_common.h"

#include <cmath>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/collectives.h>

namespace hyper_parallel::tensor_parallel::detail {

LossTargets loss_targets(const char* fn, const at::Tensor& local, const at::Tensor& targets,
                         int64_t vocab_size, const dtensor::DeviceMesh& mesh, int64_t ignore_index) {
  TORCH_CHECK_NOT_IMPLEMENTED(!at::isFloatingType(targets.scalar_type()), fn,
                              ": expected class indices as targets (an integer tensor), got ",
                              targets.scalar_type(),
                              " targets (class probabilities are not supported under loss_parallel)");
  TORCH_CHECK_TYPE(targets.scalar_type() == at::kLong, fn,
                   ": expected int64 class indices as targets (as torch's losses take), got ",
                   targets.scalar_type(), " targets (convert them with .long())");
  const auto ignored = targets == ignore_index;
  const auto ids = targets.masked_fill(ignored, 0);  // an ignored row reads class 0, and counts zero
  auto shard = vocab_shard(ids, vocab_size, mesh);
  const int64_t n = shard.size;
  TORCH_CHECK_VALUE(local.dim() >= 1 && local.size(-1) == n, fn, ": expected local logits [..., ", n,
                    "] (chunk ", mesh.get_local_rank(0), " of vocab ", vocab_size, "), got ", local.sizes());
  TORCH_CHECK_VALUE(targets.sizes() == local.sizes().slice(0, local.dim() - 1), fn,
                    ": expected targets of shape ", local.sizes().slice(0, local.dim() - 1), ", got ",
                    targets.sizes());
  if (ids.numel() > 0 && (ids.min().item<int64_t>() < 0 || ids.max().item<int64_t>() >= vocab_size)) {
    const auto kept = targets.masked_select(targets != ignore_index);
    TORCH_CHECK_VALUE(false, fn, ": expected targets in [0, ", vocab_size, ") or ignore_index (",
                      ignore_index, "), got values in [", kept.min().item<int64_t>(), ", ",
                      kept.max().item<int64_t>(), "]");
  }
  const auto kept = ignored.logical_not();
  return {ignored, kept, kept.sum(), std::move(shard)};
}

at::Tensor reduce_loss(const at::Tensor& per_token, const at::Tensor& kept_count, LossReduction reduction) {
  switch (reduction) {
    case LossReduction::kNone:
      return per_token;
    case LossReduction::kSum:
      return per_token.sum();
    case LossReduction::kMean:
      break;
  }
  return per_token.sum() / kept_count.to(per_token.scalar_type());
}

at::Tensor row_scale(const at::Tensor& grad, const at::Tensor& kept, const at::Tensor& kept_count,
                     LossReduction reduction) {
  const auto keep = kept.to(grad.scalar_type());
  // Every target ignored: torch's mean is NaN, its gradient zero (not NaN * 0).
  return reduction == LossReduction::kMean ? grad / kept_count.to(grad.scalar_type()).clamp_min(1) * keep
                                           : grad * keep;
}

at::Tensor shifted_by_global_max(const at::Tensor& logits, const comm::Group& group) {
  const auto rows = logits.sizes().slice(0, logits.dim() - 1);
  auto local_max =
      logits.size(-1) > 0 ? std::get<0>(logits.max(-1)) : at::full(rows, -INFINITY, logits.options());
  auto global_max = std::get<0>(comm::all_gather(local_max.unsqueeze(-1).contiguous(), -1, group).max(-1));
  return logits - global_max.unsqueeze(-1);
}

at::Tensor laid_out_as(const at::Tensor& gradient, const at::Tensor& input) {
  if (gradient.strides() == input.strides()) return gradient;
  return at::empty_like(input, gradient.options()).copy_(gradient);
}

}  // namespace hyper_parallel::tensor_parallel::detail
