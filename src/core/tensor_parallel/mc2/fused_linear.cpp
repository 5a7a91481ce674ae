#include <hyper_parallel/core/tensor_parallel/mc2/fused_linear.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/schedule.h>
#include <hyper_parallel/core/comm/trace.h>

#include "../../autograd/attach_backward.h"

namespace hyper_parallel::tensor_parallel {
namespace {

using detail::local_matmul;

at::Tensor sum_rows(const at::Tensor& t) {
  return t.sum(0, /*keepdim=*/false, comm::accumulate_type(t.scalar_type())).to(t.scalar_type());
}

MC2LinearNeeds needs_of(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  return {x.requires_grad(), w.requires_grad(), bias.defined() && bias.requires_grad()};
}

}  // namespace

void check_world_size_argument(const char* where, int64_t world_size, const comm::Group& group) {
  TORCH_CHECK_VALUE(world_size == group.size(), where, ": expected world_size to equal the group's size (",
                    group.size(), "), got ", world_size);
}

std::pair<at::Tensor, at::Tensor> mc2_column_forward(const at::Tensor& x, const at::Tensor& w,
                                                     const at::Tensor& bias, const comm::Group& group,
                                                     const MC2Options& options) {
  auto [y, gathered] = all_gather_matmul(x, w, group, options);
  if (bias.defined()) y.add_(bias);  // after the collective
  return {y, gathered};
}

MC2LinearGrads mc2_column_backward(const at::Tensor& dy_in, const at::Tensor& d_gathered,
                                   const at::Tensor& gathered, const at::Tensor& w, const comm::Group& group,
                                   const MC2Options& options, MC2LinearNeeds needs) {
  const auto dy =
      dy_in.defined() ? dy_in.contiguous() : at::zeros({gathered.size(0), w.size(0)}, gathered.options());
  MC2LinearGrads grads;
  // dW from the gathered X saved in forward (no second gather), and the bias's sum: independent
  // of dX's reduce-scatter, so they run while its partials travel. Who waits on whom: the
  // reduce-scatter's sends are posted, then dW, then the partials from the peers are waited for.
  const auto weight_grads = [&] {
    comm::trace::Span span("wgrad");
    if (needs.weight) grads.weight = local_matmul(dy.t(), gathered);
    if (needs.bias) grads.bias = sum_rows(dy);
  };
  // dX: the dual op, contracting over n_local: reduce_scatter(dY W (+ dG)).
  if (needs.input) {
    grads.input = mm_reduce_scatter(dy, w, group, options, d_gathered, weight_grads);
  } else {
    weight_grads();
  }
  return grads;
}

at::Tensor mc2_row_forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                           const comm::Group& group, const MC2Options& options) {
  auto y = matmul_reduce_scatter(x, w, group, options);
  if (bias.defined()) y.add_(bias);  // once, to the reduced output
  return y;
}

MC2LinearGrads mc2_row_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                const comm::Group& group, const MC2Options& options, MC2LinearNeeds needs) {
  // The dual op: gather dY (this rank's rows) while multiplying by W untransposed. dW = dY_fullᵀ X
  // needs every dY row: one GEMM after the gather. (Summing it per arrived chunk hid more of the
  // gather but, with bf16 chunk products, broke the bf16 tolerance; see docs/architecture.md.)
  auto [dx, dy_full] = all_gather_mm(dy.contiguous(), w, group, options);
  MC2LinearGrads grads;
  if (needs.input) grads.input = dx;
  if (needs.weight) grads.weight = local_matmul(dy_full.t(), x);
  if (needs.bias) grads.bias = sum_rows(dy_full);
  return grads;
}

std::pair<at::Tensor, at::Tensor> mc2_column_linear_gathered(const at::Tensor& x, const at::Tensor& w,
                                                             const at::Tensor& bias, const comm::Group& group,
                                                             const MC2Options& options) {
  at::Tensor y, gathered;
  {
    at::NoGradGuard no_grad;
    std::tie(y, gathered) = mc2_column_forward(x, w, bias, group, options);
  }
  // The closure keeps the plain gather (no autograd history), not the output: no cycle.
  auto outs = hyper_parallel::detail::attach_backward(
      {x, w, bias}, {y, gathered},
      [gathered, w = w.detach(), group, options,
       needs = needs_of(x, w, bias)](std::vector<at::Tensor> grads) -> std::vector<at::Tensor> {
        auto g = mc2_column_backward(grads[0], grads[1], gathered, w, group, options, needs);
        return {g.input, g.weight, g.bias};
      },
      "MC2ColumnLinearBackward", /*materialize_grads=*/false);
  return {outs[0], outs[1]};
}

at::Tensor mc2_column_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                             const comm::Group& group, const MC2Options& options) {
  return mc2_column_linear_gathered(x, w, bias, group, options).first;
}

at::Tensor mc2_shared_column_linear(const at::Tensor& gathered, const at::Tensor& w, const at::Tensor& bias) {
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = local_matmul(gathered, w.t());
    if (bias.defined()) y.add_(bias);
  }
  return hyper_parallel::detail::attach_backward(
      {gathered, w, bias}, {y},
      [g = gathered.detach(), w = w.detach(),
       needs = needs_of(gathered, w, bias)](std::vector<at::Tensor> grads) -> std::vector<at::Tensor> {
        const auto dy = grads[0].contiguous();
        return {needs.input ? local_matmul(dy, w) : at::Tensor(),
                needs.weight ? local_matmul(dy.t(), g) : at::Tensor(),
                needs.bias ? sum_rows(dy) : at::Tensor()};
      },
      "MC2SharedColumnLinearBackward")[0];
}

at::Tensor mc2_row_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                          const comm::Group& group, const MC2Options& options) {
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = mc2_row_forward(x, w, bias, group, options);
  }
  return hyper_parallel::detail::attach_backward(
      {x, w, bias}, {y},
      [x = x.detach(), w = w.detach(), group, options,
       needs = needs_of(x, w, bias)](std::vector<at::Tensor> grads) -> std::vector<at::Tensor> {
        auto g = mc2_row_backward(grads[0], x, w, group, options, needs);
        return {g.input, g.weight, g.bias};
      },
      "MC2RowLinearBackward")[0];
}

}  // namespace hyper_parallel::tensor_parallel
