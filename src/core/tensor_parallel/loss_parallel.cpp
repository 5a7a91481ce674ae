#include <hyper_parallel/core/tensor_parallel/loss_parallel.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm/chunks.h>
#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/dtensor/placement.h>
#include <hyper_parallel/core/tensor_parallel/parallelize.h>

#include "../autograd/attach_backward.h"
#include "vocab_loss_common.h"
#include "style_common.h"

namespace hyper_parallel::tensor_parallel {

namespace {

// d loss / d logits = (softmax - (1 - s) onehot(target) - s / V) * row_scale, each rank on its
// vocabulary chunk, in the logits' dtype (row_scale: the gradient each token's loss gets, zero for
// an ignored target; s: label smoothing). The scaled softmax is cast once into the result; then only
// the entries of targets this rank holds get their "- (1 - s)". Bitwise the unfused
// ((softmax - onehot) * row_scale).to(dtype), without its one-hot, mask-product and clone
// temporaries (the same ops in torch at 1024 tokens x 4096 logits, one thread: 48-73 ms against
// 3-9). Out-of-place but for the targets' in-place write, so autograd follows it: a double backward
// differentiates it in `grad`.
at::Tensor logits_gradient(const at::Tensor& softmax_local, const at::Tensor& target_mask,
                           const at::Tensor& local_target, const at::Tensor& row_scale, double smoothing,
                           int64_t vocab_size, at::ScalarType dtype) {
  const auto scale = row_scale.unsqueeze(-1);
  const double uniform = smoothing / static_cast<double>(vocab_size);
  auto out = ((smoothing > 0 ? softmax_local - uniform : softmax_local) * scale).to(dtype);
  const int64_t n = softmax_local.size(-1);
  if (n == 0) return out;
  // Flat positions of the targets on this rank's chunk: row * n + local id.
  const auto rows = target_mask.logical_not().reshape({-1}).nonzero().view({-1});
  const auto at_target = rows * n + local_target.reshape({-1}).index_select(0, rows);
  const auto picked = softmax_local.reshape({-1}).index_select(0, at_target);
  const auto picked_scale = scale.reshape({-1}).index_select(0, rows);
  const auto target_gradient = smoothing > 0 ? picked - uniform - (1 - smoothing)
                                             : picked - 1;  // the unsmoothed one bitwise as before
  out.view({-1}).index_copy_(0, at_target, (target_gradient * picked_scale).to(dtype));
  return out;
}

// Vocabulary-sharded logits (Shard(-1) on a 1-d mesh of 2 or more ranks) that `t` may have been
// computed from: as wide as some rank's shard, any rows (a shift, a mask, a concatenation). For a
// tensor each rank computed from its own shard the answer is the same on every rank.
bool could_come_from(const dtensor::RecentLastDimShard& logits, const at::Tensor& t) {
  if (logits.mesh_shape.size() != 1 || logits.mesh_shape[0] < 2 || logits.placements.size() != 1)
    return false;
  const auto widths = comm::chunk_sizes(logits.shape.back(), logits.mesh_shape[0]);
  return std::find(widths.begin(), widths.end(), t.size(-1)) != widths.end();
}

// Whether `t` holds the values of `local` (its elements in order, after a cast; NaN equal to NaN),
// compared a block of rows at a time, each block of the shard cast on its own.
bool holds_values_of(const at::Tensor& t, const at::Tensor& local) {
  if (t.numel() != local.numel() || t.size(-1) != local.size(-1)) return false;
  at::NoGradGuard no_grad;
  const int64_t width = std::max<int64_t>(t.size(-1), 1);
  const auto a = t.detach().reshape({-1, width}), b = local.detach().reshape({-1, width});
  const int64_t block = std::max<int64_t>(1, (int64_t{1} << 22) / width);
  for (int64_t row = 0; row < a.size(0); row += block) {
    const int64_t rows = std::min(block, a.size(0) - row);
    const auto x = a.narrow(0, row, rows), y = b.narrow(0, row, rows).to(a.scalar_type());
    if (!x.equal(y) && !((x == y) | (x.isnan() & y.isnan())).all().item<bool>()) return false;
  }
  return true;
}

std::string may_come_from(const at::Tensor& t, const dtensor::RecentLastDimShard& logits) {
  std::ostringstream s;
  s << "loss_parallel: expected the vocabulary-sharded logits, a view or a cast of them, where no "
    << "autograd graph traces a tensor back (under no_grad, after detach), got a " << t.sizes()
    << " tensor that may come from the " << c10::IntArrayRef(logits.shape) << " vocabulary-sharded logits";
  return s.str();
}

// A graph from leaves alone (a detached copy made to require grad) that reaches a leaf of another
// size than t (a learnable temperature, a per-row scale) has another operand: its gradient, computed
// beside this rank's vocabulary shard, would be this rank's part only. "a <sizes> leaf", or "".
std::string other_operand(const at::Tensor& t) {
  if (!t.grad_fn()) return {};
  for (const auto& leaf : dtensor::DTensor::trace_back(t).leaves) {
    if (leaf.numel() != t.numel()) return c10::str("a ", leaf.sizes(), " leaf");
  }
  return {};
}

std::string other_operand_error(const at::Tensor& t, const std::string& leaf) {
  return c10::str(
      "loss_parallel: expected logits computed from the vocabulary-sharded ones and tensors that take ",
      "no gradient, got a ", t.sizes(), " tensor that also differentiates through ", leaf,
      ": computed beside this rank's vocabulary shard, that gradient would be this rank's part "
      "only; detach that operand (a learnable temperature)");
}

const char* const kPass =
    "; pass the logits (kept alive until the loss), a view or a cast of them (16-bit logits are "
    "upcast inside; shift the labels, not the logits), or compute with grad enabled; logits of "
    "another model that merely share the size take torch's loss outside loss_parallel()";

}  // namespace

namespace {

// The first live logits among `shards` that `t` may come from and whose local shard it holds.
std::optional<dtensor::DTensor> held_by(const at::Tensor& t,
                                        const std::vector<dtensor::RecentLastDimShard>& shards) {
  for (const auto& logits : shards) {
    if (logits.alive && could_come_from(logits, t) && holds_values_of(t, logits.alive->to_local())) {
      return *logits.alive;
    }
  }
  return std::nullopt;
}

}  // namespace

std::optional<dtensor::DTensor> local_vocab_shard_source(const at::Tensor& t) {
  if (!t.defined() || t.dim() == 0) return std::nullopt;
  return held_by(t, dtensor::DTensor::recent_last_dim_shards());
}

std::optional<dtensor::DTensor> untraced_vocab_shard_source(const at::Tensor& t) {
  if (!t.defined() || t.dim() == 0) return std::nullopt;
  const auto recent = dtensor::DTensor::recent_last_dim_shards();
  std::vector<const dtensor::RecentLastDimShard*> alive, gone;
  for (const auto& logits : recent) {
    if (could_come_from(logits, t)) (logits.alive ? alive : gone).push_back(&logits);
  }
  if (alive.empty() && gone.empty()) return std::nullopt;
  const auto other = other_operand(t);
  TORCH_CHECK_NOT_IMPLEMENTED(!alive.empty() || other.empty(), other_operand_error(t, other));
  TORCH_CHECK_VALUE(!alive.empty(), may_come_from(t, *gone.front()),
                    ", which are gone: nothing to compare its values with", kPass);
  const auto source = held_by(t, recent);
  // The ranks agree: each rank's tensor is its own shard's and has no other operand, or none
  // computes the loss (shards of uneven widths: the sizes compared differ between ranks).
  const auto& mesh = alive.front()->alive->device_mesh();
  const auto flags = comm::all_reduce(at::tensor({source ? 0.0F : 1.0F, other.empty() ? 0.0F : 1.0F}),
                                      comm::ReduceOp::kSum, mesh.get_group(0));
  const auto differing = static_cast<int64_t>(flags[0].item<float>());
  const auto with_other = static_cast<int64_t>(flags[1].item<float>());
  TORCH_CHECK_NOT_IMPLEMENTED(
      with_other == 0,
      other_operand_error(
          t, other.empty() ? c10::str("a leaf of another size on ", with_other, " of ", mesh.size(), " ranks")
                           : other));
  TORCH_CHECK_VALUE(differing == 0, may_come_from(t, *alive.front()),
                    source ? ", holding this rank's shard of them, but other ranks' do not"
                           : ", not holding this rank's shard of them",
                    " (", differing, " of ", mesh.size(), " ranks differ)", kPass);
  return *source;
}

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& local_logits, const at::Tensor& targets,
                                        int64_t vocab_size, const dtensor::DeviceMesh& mesh,
                                        const CrossEntropyOptions& options) {
  check_tp_mesh("vocab_parallel_cross_entropy", mesh);
  TORCH_CHECK_VALUE(options.label_smoothing() >= 0 && options.label_smoothing() <= 1,
                    "vocab_parallel_cross_entropy: expected label_smoothing in [0, 1], got ",
                    options.label_smoothing());
  const auto targets_of = detail::loss_targets("vocab_parallel_cross_entropy", local_logits, targets,
                                               vocab_size, mesh, options.ignore_index());
  const auto& shard = targets_of.shard;
  const int64_t n = shard.size;
  auto group = mesh.get_group(0);
  // The target's logit lives on exactly one rank.
  const at::Tensor target_mask = shard.outside, local_target = shard.local_ids, ignored = targets_of.ignored,
                   kept = targets_of.kept, kept_count = targets_of.kept_count;
  const double smoothing = options.label_smoothing();
  const bool needs_grad = at::GradMode::is_enabled() && local_logits.requires_grad();
  at::Tensor loss, softmax_local;
  {
    at::NoGradGuard no_grad;
    // 16-bit logits are computed in float32; float64 stays float64.
    const auto compute = at::promote_types(local_logits.scalar_type(), at::kFloat);
    auto logits = local_logits.to(compute);
    auto shifted = detail::shifted_by_global_max(logits, group);  // for a stable exp
    auto exp = shifted.exp();
    auto sum_exp = comm::all_reduce(exp.sum(-1), comm::ReduceOp::kSum, group);
    auto picked = n > 0 ? shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
                        : at::zeros(targets.sizes(), logits.options());
    picked = comm::all_reduce(picked.masked_fill(target_mask, 0), comm::ReduceOp::kSum, group);
    const auto log_sum_exp = sum_exp.log();
    auto per_token = log_sum_exp - picked;
    if (smoothing > 0) {  // the uniform target's term: log-sum-exp minus the mean logit
      auto sum_shifted = comm::all_reduce(shifted.sum(-1), comm::ReduceOp::kSum, group);
      per_token = (1 - smoothing) * per_token +
                  smoothing * (log_sum_exp - sum_shifted / static_cast<double>(vocab_size));
    }
    loss = detail::reduce_loss(per_token.masked_fill(ignored, 0), kept_count, options.reduction());
    // Only a backward reads the softmax: an eval loss skips its pass over the logits.
    if (!needs_grad) return loss;
    softmax_local = exp / sum_exp.unsqueeze(-1);
  }
  loss = hyper_parallel::detail::attach_backward(
      local_logits, loss,
      [softmax_local, target_mask, local_target, kept, kept_count, options, vocab_size,
       dtype = local_logits.scalar_type()](const at::Tensor& grad) {
        return logits_gradient(softmax_local, target_mask, local_target,
                               detail::row_scale(grad, kept, kept_count, options.reduction()),
                               options.label_smoothing(), vocab_size, dtype);
      },
      "VocabParallelCrossEntropyBackward");
  // The gradient reads the saved softmax: no second derivative through it.
  if (loss.grad_fn()) hyper_parallel::detail::mark_first_order_only(*loss.grad_fn());
  return loss;
}

}  // namespace hyper_parallel::tensor_parallel
