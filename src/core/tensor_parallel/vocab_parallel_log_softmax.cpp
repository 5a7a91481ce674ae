#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/dtensor/placement.h>
#include <hyper_parallel/core/tensor_parallel/loss_parallel.h>
#include <hyper_parallel/core/tensor_parallel/parallelize.h>

#include "../autograd/attach_backward.h"
#include "vocab_loss_common.h"

// torch's unfused cross-entropy, nll_loss(log_softmax(x, -1)), over vocabulary-sharded x: each
// rank holds its chunk of the log-probabilities, and the loss reads each target's entry on the
// rank that holds it.

namespace hyper_parallel::tensor_parallel {

namespace {

void check_floating_on_tp_mesh(const char* fn, const at::Tensor& local, const dtensor::DeviceMesh& mesh) {
  check_tp_mesh(fn, mesh);
  TORCH_CHECK_TYPE(at::isFloatingType(local.scalar_type()), fn, ": expected floating-point input, got ",
                   local.scalar_type());
}

}  // namespace

dtensor::DTensor vocab_parallel_log_softmax(const at::Tensor& local_logits, int64_t vocab_size,
                                            const dtensor::DeviceMesh& mesh) {
  const char* fn = "vocab_parallel_log_softmax";
  check_floating_on_tp_mesh(fn, local_logits, mesh);
  const int64_t n = dtensor::shard_size(vocab_size, mesh.size(0), mesh.get_local_rank(0));
  TORCH_CHECK_VALUE(local_logits.dim() >= 1 && local_logits.size(-1) == n, fn,
                    ": expected local logits [..., ", n, "] (chunk ", mesh.get_local_rank(0), " of vocab ",
                    vocab_size, "), got ", local_logits.sizes());
  const auto group = mesh.get_group(0);
  const auto dtype = local_logits.scalar_type();
  const auto compute = at::promote_types(dtype, at::kFloat);  // 16-bit inputs computed in float32
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    const auto shifted = detail::shifted_by_global_max(local_logits.to(compute), group);
    const auto sum_exp = comm::all_reduce(shifted.exp().sum(-1), comm::ReduceOp::kSum, group);
    out = (shifted - sum_exp.log().unsqueeze(-1)).to(dtype);
  }
  // Saved detached (the closure lives in out's own node); its version catches a write before the
  // backward reads it, as autograd's saved tensors do.
  const auto saved = out.detach();
  out = hyper_parallel::detail::attach_backward(
      local_logits, out,
      [saved, version = saved._version(), group, compute, dtype,
       input = local_logits.detach()](const at::Tensor& grad) {
        TORCH_CHECK_VALUE(saved._version() == version,
                          "vocab_parallel_log_softmax: expected its output unchanged until the backward, got "
                          "one modified in place");
        // d x = d y - softmax * sum over the whole vocabulary of d y: one all-reduce of [...].
        const auto g = grad.to(compute);
        const auto total = comm::all_reduce(g.sum(-1), comm::ReduceOp::kSum, group);
        return detail::laid_out_as((g - saved.to(compute).exp() * total.unsqueeze(-1)).to(dtype), input);
      },
      "VocabParallelLogSoftmaxBackward");
  if (out.grad_fn()) hyper_parallel::detail::mark_first_order_only(*out.grad_fn());  // reads the saved output
  auto shape = local_logits.sizes().vec();
  shape.back() = vocab_size;
  return dtensor::DTensor::from_local(out, mesh, {dtensor::Shard(-1)},
                                      dtensor::FromLocalOptions().shape(shape));
}

at::Tensor vocab_parallel_nll_loss(const at::Tensor& local_input, const at::Tensor& targets,
                                   int64_t vocab_size, const dtensor::DeviceMesh& mesh,
                                   LossReduction reduction, int64_t ignore_index) {
  const char* fn = "vocab_parallel_nll_loss";
  check_floating_on_tp_mesh(fn, local_input, mesh);
  const auto t = detail::loss_targets(fn, local_input, targets, vocab_size, mesh, ignore_index);
  const auto dtype = local_input.scalar_type();
  const auto compute = at::promote_types(dtype, at::kFloat);
  const int64_t n = t.shard.size;
  at::Tensor loss;
  {
    at::NoGradGuard no_grad;
    // The target's entry lives on exactly one rank.
    auto picked = n > 0 ? local_input.gather(-1, t.shard.local_ids.unsqueeze(-1)).squeeze(-1).to(compute)
                        : at::zeros(targets.sizes(), local_input.options().dtype(compute));
    picked =
        comm::all_reduce(picked.masked_fill(t.shard.outside, 0), comm::ReduceOp::kSum, mesh.get_group(0));
    loss = detail::reduce_loss((-picked).masked_fill(t.ignored, 0), t.kept_count, reduction);
  }
  return hyper_parallel::detail::attach_backward(
      local_input, loss,
      [t, reduction, dtype, n, input = local_input.detach()](const at::Tensor& grad) {
        // -row_scale at each target's entry on the rank that holds it; zero elsewhere.
        auto out = at::zeros(input.sizes(),
                             input.options().dtype(dtype).memory_format(at::MemoryFormat::Contiguous));
        if (n == 0) return detail::laid_out_as(out, input);
        const auto scale = detail::row_scale(grad, t.kept, t.kept_count, reduction).reshape({-1});
        const auto rows = t.shard.outside.logical_not().reshape({-1}).nonzero().view({-1});
        const auto at_target = rows * n + t.shard.local_ids.reshape({-1}).index_select(0, rows);
        out.view({-1}).index_copy_(0, at_target, (-scale.index_select(0, rows)).to(dtype));
        return detail::laid_out_as(out, input);
      },
      "VocabParallelNllLossBackward");
}

}  // namespace hyper_parallel::tensor_parallel
