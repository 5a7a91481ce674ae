#include <hyper_parallel/core/tensor_parallel/mc2/linear.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <hyper_parallel/core/tensor_parallel/mc2/fused_linear.h>
#include <hyper_parallel/core/tensor_parallel/mc2/sequence_layout.h>
#include <hyper_parallel/core/nn/hookable_module.h>

#include "shared_gather.h"

namespace hyper_parallel::tensor_parallel {

// ---- MC2Linear --------------------------------------------------------------------------------

class MC2LinearKernel final : public nn::ForwardKernel {
 public:
  at::Tensor forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) override {
    // Not configured (no style applied, no configure_mc2): a plain Linear, as the original's
    // MC2Linear on a tensor that is not sharded (a model run without parallelism).
    if (!configured) return at::linear(x, w, bias);
    const auto where =
        label.empty() ? std::string("MC2Linear::forward") : "MC2Linear(" + label + ")::forward";
    contract.check_dtype(where.c_str(), x.scalar_type());
    TORCH_CHECK(x.dim() >= 2, where, ": expected an activation [..., S, ..., H], got ", x.sizes());
    const int64_t seq = normalize_sequence_dim(sequence_dim, x.dim() - 1);
    const int64_t p = group.size();
    // The contract's limits on the local weight, for a layer configured without a style (the
    // styles check them at apply time, for every rank's shard).
    contract.check_local_weight(where.c_str(), mode, w.sizes());
    if (mode == MC2Mode::kAllGather) {
      at::Tensor y;
      if (auto shared = detail::SharedGather::get().lookup(x, seq, group, this); shared.defined()) {
        y = mc2_shared_column_linear(shared, w, bias, options);
      } else {
        at::Tensor gathered;
        std::tie(y, gathered) = mc2_column_linear_gathered(sequence_rows(x, seq), w, bias, group, options);
        detail::SharedGather::get().remember(x, seq, group, gathered, this);
      }
      return from_sequence_rows(y, x, seq, x.size(seq) * p);
    }
    auto rows = sequence_rows(x, seq);  // checks seq is not the feature dim
    TORCH_CHECK_VALUE(x.size(seq) % p == 0, where,
                      ": reduce_scatter needs the sequence "
                      "length (dim ",
                      seq, " of ", x.sizes(), ") divisible by world_size ", p, ", got ", x.size(seq));
    auto y = mc2_row_linear(rows, w, bias, group, options);
    return from_sequence_rows(y, x, seq, x.size(seq) / p);
  }
  std::string name() const override {
    return std::string("MC2Linear(") + (configured ? to_string(mode) : "unconfigured") + ")";
  }

  bool configured = false;
  std::string label;
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
  TORCH_CHECK(hm->forward_kernel() == nullptr,
              "MC2Linear::from_linear: expected a Linear with the "
              "default forward, got one already using ",
              hm->forward_kernel()->name());
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

void MC2Linear::configure_mc2(MC2Mode mode, const comm::Group& group, int64_t world_size,
                              int64_t sequence_dim, const MC2Contract& contract,
                              const MC2Options& options) const {
  check_world_size_argument("MC2Linear::configure_mc2", world_size, group);
  configure_mc2(mode, group, sequence_dim, contract, options);
}

void MC2Linear::configure_mc2(MC2Mode mode, const comm::Group& group, int64_t sequence_dim,
                              const MC2Contract& contract, const MC2Options& options) const {
  TORCH_CHECK(group.is_member(),
              "MC2Linear::configure_mc2: expected a group this rank belongs to, "
              "got a non-member group");
  contract.check_world_size("MC2Linear::configure_mc2", group.size());
  MC2Options::check_chunks_per_rank("MC2Linear::configure_mc2", options.chunks_per_rank());
  kernel_->mode = mode;
  kernel_->group = group;
  kernel_->sequence_dim = sequence_dim;
  kernel_->contract = contract;
  kernel_->options = options;
  kernel_->configured = true;
}

void MC2Linear::set_label(std::string label) const { kernel_->label = std::move(label); }
const std::string& MC2Linear::label() const { return kernel_->label; }
bool MC2Linear::is_configured() const { return kernel_->configured; }
MC2Mode MC2Linear::mode() const { return kernel_->mode; }
const comm::Group& MC2Linear::group() const { return kernel_->group; }
int64_t MC2Linear::world_size() const { return kernel_->group.size(); }
int64_t MC2Linear::sequence_dim() const { return kernel_->sequence_dim; }
const MC2Contract& MC2Linear::contract() const { return kernel_->contract; }
const MC2Options& MC2Linear::options() const { return kernel_->options; }

}  // namespace hyper_parallel::tensor_parallel
