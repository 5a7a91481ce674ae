#include <hyper_parallel/core/tensor_parallel/mc2/fused_linear.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/schedule.h>
#include <hyper_parallel/core/comm/trace.h>

#include "../../autograd/attach_backward.h"
#include "../../autograd/weight_grad_scheduler.h"
#include "../../autograd/saved_tensor.h"
#include "deferred_weight_grad.h"

namespace hyper_parallel::tensor_parallel {
namespace {

using detail::local_matmul;
using hyper_parallel::detail::SavedTensor;

at::Tensor sum_rows(const at::Tensor& t) {
  return t.sum(0, /*keepdim=*/false, comm::accumulate_type(t.scalar_type())).to(t.scalar_type());
}

MC2LinearNeeds needs_of(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  return {x.requires_grad(), w.requires_grad(), bias.defined() && bias.requires_grad()};
}

// {dW = dYᵀ A, db = Σ_rows dY} as asked for.
std::vector<at::Tensor> weight_grads_of(const at::Tensor& dy, const at::Tensor& a, MC2LinearNeeds needs) {
  return {needs.weight ? local_matmul(dy.t(), a) : at::Tensor(), needs.bias ? sum_rows(dy) : at::Tensor()};
}

// The gather host (autograd/weight_grad_scheduler.h) whose window a layer's weight gradient can run in,
// when deferral is on and the layer has a weight gradient to compute.
std::optional<uint64_t> deferral_host(std::optional<uint64_t> host, const MC2Options& options,
                                      MC2LinearNeeds needs) {
  if (!options.defer_weight_grads() || !(needs.weight || needs.bias)) return std::nullopt;
  if (!c10::GradMode::is_enabled()) return std::nullopt;
  return host;
}

// The row backward's gather: dX = all_gather(dY) W while the last chunks travel the weight
// gradients earlier layers deferred into this window run; returns (dX, dY_full).
std::pair<at::Tensor, at::Tensor> row_gather(const at::Tensor& dy, const at::Tensor& w,
                                             const comm::Group& group, const MC2Options& options) {
  return all_gather_mm(dy.contiguous(), w, group, options,
                       [] { hyper_parallel::detail::WeightGradScheduler::of_this_thread().run_posted(); });
}

// A backward with create_graph=True runs with grad mode on: the fused ops compute their gradients
// with out= matmuls and collectives autograd cannot differentiate, so it is refused by name.
void check_not_differentiated(const char* name) {
  TORCH_CHECK_NOT_IMPLEMENTED(!at::GradMode::is_enabled(), name,
                              ": expected a backward without create_graph, got create_graph=True (a double "
                              "backward through MC2's fused ops, e.g. a gradient penalty, is not supported; "
                              "use ColwiseParallel / RowwiseParallel for such a model)");
}

// A Linear's backward, split where deferral cuts it: from dY, dX (undefined when not needed) and
// the job computing {dW, db}.
using SplitBackward =
    std::function<std::pair<at::Tensor, detail::DeferredWeightGrad::Job>(const at::Tensor& dy)>;

// Makes y differentiable with `backward`. With no host, one node returns dX, dW and db; with one,
// the node returns dX and posts the job, and a delivery node after the host hands dW and db on.
at::Tensor attach_linear_backward(const at::Tensor& input, const at::Tensor& w, const at::Tensor& bias,
                                  const at::Tensor& y, std::optional<uint64_t> host, SplitBackward backward,
                                  const char* name) {
  if (!host) {
    return hyper_parallel::detail::attach_backward(
        {input, w, bias}, {y},
        [backward = std::move(backward), name](std::vector<at::Tensor> grads) {
          check_not_differentiated(name);
          auto [dx, job] = backward(grads[0]);
          auto wb = job();
          return std::vector<at::Tensor>{dx, wb[0], wb[1]};
        },
        name)[0];
  }
  auto slot = std::make_shared<detail::DeferredWeightGrad>();
  const auto token = detail::deliver_weight_grad(slot, w, bias, *host);
  return hyper_parallel::detail::attach_backward(
      {input, token}, {y},
      [backward = std::move(backward), slot, name](std::vector<at::Tensor> grads) {
        check_not_differentiated(name);
        auto [dx, job] = backward(grads[0]);
        slot->post(std::move(job));
        return std::vector<at::Tensor>{dx, at::Tensor()};
      },
      name)[0];
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
    auto wb = weight_grads_of(dy, gathered, needs);
    grads.weight = wb[0];
    grads.bias = wb[1];
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
  // The dual op: gather dY (this rank's rows) while multiplying by W untransposed; the weight
  // gradients that earlier layers deferred run while the last chunks travel. dW = dY_fullᵀ X
  // needs every dY row: one GEMM after the gather. (Summing it per arrived chunk hid more of the
  // gather but, with bf16 chunk products, broke the bf16 tolerance; see docs/architecture.md.)
  auto [dx, dy_full] = row_gather(dy, w, group, options);
  auto wb = weight_grads_of(dy_full, x, needs);
  return {needs.input ? dx : at::Tensor(), wb[0], wb[1]};
}

std::pair<at::Tensor, at::Tensor> mc2_column_linear_gathered(const at::Tensor& x, const at::Tensor& w,
                                                             const at::Tensor& bias, const comm::Group& group,
                                                             const MC2Options& options) {
  at::Tensor y, gathered;
  {
    at::NoGradGuard no_grad;
    std::tie(y, gathered) = mc2_column_forward(x, w, bias, group, options);
  }
  // The closure keeps the plain gather (no autograd history), not the output: no cycle. The
  // gather and the weight are read at their forward versions (an in-place change is an error).
  const char* name = "MC2ColumnLinearBackward";
  auto outs = hyper_parallel::detail::attach_backward(
      {x, w, bias}, {y, gathered},
      [g = SavedTensor(gathered, name, "gathered input"), w = SavedTensor(w, name, "weight"), group, options,
       needs = needs_of(x, w, bias)](std::vector<at::Tensor> grads) -> std::vector<at::Tensor> {
        check_not_differentiated("MC2ColumnLinearBackward");
        auto r = mc2_column_backward(grads[0], grads[1], g.get(), w.get(), group, options, needs);
        return {r.input, r.weight, r.bias};
      },
      name, /*materialize_grads=*/false);
  return {outs[0], outs[1]};
}

at::Tensor mc2_column_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                             const comm::Group& group, const MC2Options& options) {
  return mc2_column_linear_gathered(x, w, bias, group, options).first;
}

at::Tensor mc2_shared_column_linear(const at::Tensor& gathered, const at::Tensor& w, const at::Tensor& bias,
                                    const MC2Options& options) {
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = local_matmul(gathered, w.t());
    if (bias.defined()) y.add_(bias);
  }
  const auto needs = needs_of(gathered, w, bias);
  // dG = dY W joins the gathering layer's reduce-scatter; dW = dYᵀ G runs in the window of the
  // gather host recorded last before this layer (the next gather of the backward).
  return attach_linear_backward(
      gathered, w, bias, y,
      deferral_host(hyper_parallel::detail::WeightGradScheduler::of_this_thread().host(), options, needs),
      [g = SavedTensor(gathered, "MC2SharedColumnLinearBackward", "gathered input"),
       w = SavedTensor(w, "MC2SharedColumnLinearBackward", "weight"), needs](const at::Tensor& dy_in) {
        auto dy = dy_in.contiguous();
        auto dx = needs.input ? local_matmul(dy, w.get()) : at::Tensor();
        return std::make_pair(dx, detail::DeferredWeightGrad::Job(
                                      [dy, g, needs] { return weight_grads_of(dy, g.get(), needs); }));
      },
      "MC2SharedColumnLinearBackward");
}

at::Tensor mc2_row_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                          const comm::Group& group, const MC2Options& options) {
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = mc2_row_forward(x, w, bias, group, options);
  }
  const auto needs = needs_of(x, w, bias);
  // dW = dY_fullᵀ X needs the whole gather: with a host, it runs in the next backward gather's window.
  y = attach_linear_backward(
      x, w, bias, y,
      deferral_host(hyper_parallel::detail::WeightGradScheduler::of_this_thread().host(), options, needs),
      [x = SavedTensor(x, "MC2RowLinearBackward", "input"),
       w = SavedTensor(w, "MC2RowLinearBackward", "weight"), group, options, needs](const at::Tensor& dy) {
        auto [dx, dy_full] = row_gather(dy, w.get(), group, options);
        return std::make_pair(needs.input ? dx : at::Tensor(),
                              detail::DeferredWeightGrad::Job([dy_full = dy_full, x, needs] {
                                return weight_grads_of(dy_full, x.get(), needs);
                              }));
      },
      "MC2RowLinearBackward");
  // This row's gather window hosts the weight gradients of the layers recorded after it.
  hyper_parallel::detail::WeightGradScheduler::of_this_thread().remember_host(y);
  return y;
}

}  // namespace hyper_parallel::tensor_parallel
