#include <hyper_parallel/core/tensor_parallel/mc2/linear.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <hyper_parallel/core/comm/schedule.h>
#include <hyper_parallel/core/tensor_parallel/mc2/sequence_layout.h>
#include <hyper_parallel/core/nn/hookable_module.h>

#include "../../autograd/attach_backward.h"
#include "shared_gather.h"

namespace hyper_parallel::tensor_parallel {

// ---- Autograd ---------------------------------------------------------------------------------

namespace {

using detail::local_matmul;

at::Tensor sum_rows(const at::Tensor& t) {
  return t.sum(0, /*keepdim=*/false, comm::accumulate_type(t.scalar_type())).to(t.scalar_type());
}

// The column-parallel Linear: (y, G) with G = all_gather(x) returned as a differentiable
// output, so that other layers reading the same activation can multiply G directly
// (shared_column_linear). Backward: dX = reduce_scatter(dY W + dG) in one fused ring, where dG
// is the sum of those layers' (local, uncommunicated) gradients; dW = dYᵀ G; db = Σ_rows dY.
std::pair<at::Tensor, at::Tensor> column_linear(const at::Tensor& x, const at::Tensor& w,
                                                const at::Tensor& bias, const comm::Group& group,
                                                const MC2Options& options) {
  at::Tensor y, gathered;
  {
    at::NoGradGuard no_grad;
    std::tie(y, gathered) = all_gather_matmul(x, w, group, options);
    if (bias.defined()) y.add_(bias);  // after the collective
  }
  // The closure keeps the plain gather (no autograd history), not the output: no cycle.
  auto outs = hyper_parallel::detail::attach_backward(
      {x, w, bias}, {y, gathered},
      [gathered, w = w.detach(), group, options, need_x = x.requires_grad(),
       need_w = w.requires_grad(), need_b = bias.defined() && bias.requires_grad()](
          std::vector<at::Tensor> grads) -> std::vector<at::Tensor> {
        const auto dy = grads[0].defined()
                            ? grads[0].contiguous()
                            : at::zeros({gathered.size(0), w.size(0)}, gathered.options());
        const auto& d_gathered = grads[1];  // undefined unless another layer shared the gather
        at::Tensor dx, dw, db;
        // dX: the dual op, contracting over n_local: reduce_scatter(dY W (+ dG)).
        if (need_x) dx = mm_reduce_scatter(dy, w, group, options, d_gathered);
        // dW from the gathered X saved in forward: no second gather.
        if (need_w) dw = local_matmul(dy.t(), gathered);
        if (need_b) db = sum_rows(dy);
        return {dx, dw, db};
      },
      "MC2ColumnLinearBackward", /*materialize_grads=*/false);
  return {outs[0], outs[1]};
}

// A column-parallel Linear on a gather another MC2 layer already made: y = G Wᵀ + b, no
// communication. Its input gradient dG = dY W stays local and joins the gathering layer's
// reduce-scatter.
at::Tensor shared_column_linear(const at::Tensor& gathered, const at::Tensor& w,
                                const at::Tensor& bias) {
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = local_matmul(gathered, w.t());
    if (bias.defined()) y.add_(bias);
  }
  return hyper_parallel::detail::attach_backward(
      {gathered, w, bias}, {y},
      [g = gathered.detach(), w = w.detach(), need_g = gathered.requires_grad(),
       need_w = w.requires_grad(), need_b = bias.defined() && bias.requires_grad()](
          std::vector<at::Tensor> grads) -> std::vector<at::Tensor> {
        const auto dy = grads[0].contiguous();
        return {need_g ? local_matmul(dy, w) : at::Tensor(),
                need_w ? local_matmul(dy.t(), g) : at::Tensor(), need_b ? sum_rows(dy) : at::Tensor()};
      },
      "MC2SharedColumnLinearBackward")[0];
}

}  // namespace

at::Tensor mc2_column_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                             const comm::Group& group, const MC2Options& options) {
  return column_linear(x, w, bias, group, options).first;
}

at::Tensor mc2_row_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                          const comm::Group& group, const MC2Options& options) {
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = matmul_reduce_scatter(x, w, group, options);
    if (bias.defined()) y.add_(bias);  // once, to the reduced output
  }
  return hyper_parallel::detail::attach_backward(
      {x, w, bias}, {y},
      [x = x.detach(), w = w.detach(), group, options, need_x = x.requires_grad(),
       need_w = w.requires_grad(), need_b = bias.defined() && bias.requires_grad()](
          std::vector<at::Tensor> grads) -> std::vector<at::Tensor> {
        // The dual op: gather dY (this rank's rows) while multiplying by W untransposed.
        auto [dx, dy_full] = all_gather_mm(grads[0].contiguous(), w, group, options);
        at::Tensor dw, db;
        if (need_w) dw = local_matmul(dy_full.t(), x);
        if (need_b) db = sum_rows(dy_full);
        return {need_x ? dx : at::Tensor(), dw, db};
      },
      "MC2RowLinearBackward")[0];
}

// ---- MC2Linear --------------------------------------------------------------------------------

class MC2LinearKernel final : public nn::ForwardKernel {
 public:
  at::Tensor forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) override {
    TORCH_CHECK(configured, "MC2Linear::forward: used before configure_mc2(mode, group, "
                "sequence_dim); apply MC2ColwiseParallel / MC2RowwiseParallel or configure it");
    contract.check_dtype("MC2Linear::forward", x.scalar_type());
    TORCH_CHECK(x.dim() >= 2, "MC2Linear::forward: expected an activation [..., S, ..., H], got ",
                x.sizes());
    const int64_t seq = sequence_dim < 0 ? sequence_dim + x.dim() : sequence_dim;
    const int64_t p = group.size();
    // The contract's limits on the local weight, for a layer configured without a style (the
    // styles check them at apply time, for every rank's shard).
    contract.check_local_weight("MC2Linear::forward", mode, w.sizes());
    if (mode == MC2Mode::kAllGather) {
      at::Tensor y;
      if (auto shared = detail::SharedGather::get().lookup(x, seq, group, this); shared.defined()) {
        y = shared_column_linear(shared, w, bias);
      } else {
        at::Tensor gathered;
        std::tie(y, gathered) = column_linear(sequence_rows(x, seq), w, bias, group, options);
        detail::SharedGather::get().remember(x, seq, group, gathered, this);
      }
      return from_sequence_rows(y, x, seq, x.size(seq) * p);
    }
    auto rows = sequence_rows(x, seq);  // checks seq is not the feature dim
    TORCH_CHECK_VALUE(x.size(seq) % p == 0, "MC2Linear::forward: reduce_scatter needs the sequence "
                "length (dim ", seq, " of ", x.sizes(), ") divisible by world_size ", p, ", got ",
                x.size(seq));
    auto y = mc2_row_linear(rows, w, bias, group, options);
    return from_sequence_rows(y, x, seq, x.size(seq) / p);
  }
  std::string name() const override {
    return std::string("MC2Linear(") + (configured ? to_string(mode) : "unconfigured") + ")";
  }

  bool configured = false;
  MC2Mode mode = MC2Mode::kAllGather;
  comm::Group group;
  int64_t sequence_dim = 1;
  MC2Contract contract;
  MC2Options options;
};

MC2Linear MC2Linear::from_linear(torch::nn::Module& module) {
  auto* hm = dynamic_cast<nn::HookableModule*>(&module);
  TORCH_CHECK(hm != nullptr && hm->module_kind() == nn::ModuleKind::kLinear,
              "MC2Linear::from_linear: expected a hyper_parallel::nn::Linear, got ", module.name());
  if (auto existing = std::dynamic_pointer_cast<MC2LinearKernel>(hm->forward_kernel())) {
    return MC2Linear(existing);
  }
  TORCH_CHECK(hm->forward_kernel() == nullptr, "MC2Linear::from_linear: expected a Linear with the "
              "default forward, got one already using ", hm->forward_kernel()->name());
  auto kernel = std::make_shared<MC2LinearKernel>();
  hm->set_forward_kernel(kernel);
  return MC2Linear(kernel);
}

std::optional<MC2Linear> MC2Linear::of(torch::nn::Module& module) {
  auto* hm = dynamic_cast<nn::HookableModule*>(&module);
  if (hm == nullptr) return std::nullopt;
  auto kernel = std::dynamic_pointer_cast<MC2LinearKernel>(hm->forward_kernel());
  if (!kernel) return std::nullopt;
  return MC2Linear(kernel);
}

MC2Linear MC2Linear::standalone() { return MC2Linear(std::make_shared<MC2LinearKernel>()); }

at::Tensor MC2Linear::forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) const {
  return kernel_->forward(x, w, bias);
}

void MC2Linear::configure_mc2(MC2Mode mode, const comm::Group& group, int64_t sequence_dim,
                              const MC2Contract& contract, const MC2Options& options) const {
  TORCH_CHECK(group.is_member(), "MC2Linear::configure_mc2: expected a group this rank belongs to, "
              "got a non-member group");
  contract.check_world_size("MC2Linear::configure_mc2", group.size());
  TORCH_CHECK(options.chunks_per_rank() >= 1,
              "MC2Linear::configure_mc2: expected chunks_per_rank >= 1, got ", options.chunks_per_rank());
  kernel_->mode = mode;
  kernel_->group = group;
  kernel_->sequence_dim = sequence_dim;
  kernel_->contract = contract;
  kernel_->options = options;
  kernel_->configured = true;
}

bool MC2Linear::is_configured() const { return kernel_->configured; }
MC2Mode MC2Linear::mode() const { return kernel_->mode; }
const comm::Group& MC2Linear::group() const { return kernel_->group; }
int64_t MC2Linear::world_size() const { return kernel_->group.size(); }
int64_t MC2Linear::sequence_dim() const { return kernel_->sequence_dim; }
const MC2Contract& MC2Linear::contract() const { return kernel_->contract; }
const MC2Options& MC2Linear::options() const { return kernel_->options; }

}  // namespace hyper_parallel::tensor_parallel
