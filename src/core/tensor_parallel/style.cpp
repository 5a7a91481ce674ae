#include <hyper_parallel/core/tensor_parallel/style.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <hyper_parallel/core/dtensor/dtensor.h>
#include <hyper_parallel/core/nn/hookable_module.h>
#include <hyper_parallel/core/tensor_parallel/parallelize.h>

#include "style_common.h"

namespace hyper_parallel::tensor_parallel {

using dtensor::DeviceMesh;
using dtensor::Placement;
using dtensor::Replicate;
using dtensor::Shard;
using nn::ModuleKind;

void ParallelStyle::apply(torch::nn::Module& module, const DeviceMesh& mesh,
                          std::optional<int64_t> src_data_rank) const {
  const auto style = name();
  // The module's kind first, before the mesh is looked at.
  if (auto* hm = dynamic_cast<nn::HookableModule*>(&module)) check_kind(detail::target_of(*hm, module));
  check_tp_mesh(style.c_str(), mesh);
  apply_to(module, mesh, src_data_rank);
  if (auto* hm = dynamic_cast<nn::HookableModule*>(&module)) hm->add_applied_style(style);
}

namespace {

// A style's hook methods as forward kernels of this library's modules.
class LinearKernel final : public nn::ForwardKernel {
 public:
  using Fn = std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>;
  LinearKernel(std::string name, Fn fn) : name_(std::move(name)), fn_(std::move(fn)) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) override {
    return fn_(x, weight, bias);
  }
  std::string name() const override { return name_; }

 private:
  std::string name_;
  Fn fn_;
};

void check_linear_or_embedding(const std::string& style, const ModuleTarget& target,
                               const ModuleTypeNames& names) {
  TORCH_CHECK_TYPE(target.kind == ModuleKind::kLinear || target.kind == ModuleKind::kEmbedding, style,
                   ": expected ", names.linear, " or ", names.embedding, ", got ", target.type,
                   "; only those are supported");
}

void check_not_partial(const char* style, const char* what, const Placement& p) {
  TORCH_CHECK_VALUE(!p.is_partial(), style, ": expected ", what, " Shard or Replicate, got ", p.str());
}

// Installs an input hook that replaces the first input.
template <typename Fn>
void on_first_input(nn::HookableModule& hm, Fn fn) {
  hm.add_input_hook([fn](std::vector<at::Tensor> inputs) {
    inputs[0] = fn(inputs[0]);
    return inputs;
  });
}

// Installs an output hook that replaces the first output.
template <typename Fn>
void on_first_output(nn::HookableModule& hm, Fn fn) {
  hm.add_output_hook([fn](std::vector<at::Tensor> outputs) {
    outputs[0] = fn(outputs[0]);
    return outputs;
  });
}

}  // namespace

// ---- ColwiseParallel ----------------------------------------------------------------------

ColwiseParallel::ColwiseParallel(ColwiseParallelOptions options) : options_(options) {
  check_not_partial("ColwiseParallel", "input_layouts", options_.input_layouts());
  check_not_partial("ColwiseParallel", "output_layouts", options_.output_layouts());
}

void ColwiseParallel::check_kind(const ModuleTarget& target, const ModuleTypeNames& names) const {
  check_linear_or_embedding(name(), target, names);
}

std::vector<ParameterSharding> ColwiseParallel::parameter_shardings(
    ModuleKind kind, const std::vector<std::string>& parameters) const {
  if (kind == ModuleKind::kEmbedding) return detail::shard_each(parameters, {{"weight", {Shard(1)}}});
  return detail::shard_each(parameters, {{"weight", {Shard(0)}}, {"bias", {Shard(0)}}});
}

at::Tensor ColwiseParallel::prepare_input(const at::Tensor& input, ModuleKind kind,
                                          const DeviceMesh& mesh) const {
  // A Linear's gradient out of the column-sharded matmul is Partial.
  if (kind == ModuleKind::kLinear) return detail::replicate_for_column(input, mesh, options_.input_layouts());
  return detail::prepare(input, mesh, options_.input_layouts(), Replicate(), true);
}

at::Tensor ColwiseParallel::prepare_output(const at::Tensor& output, const DeviceMesh& mesh,
                                           std::optional<int64_t> features) const {
  return detail::prepare_column_output("ColwiseParallel", output, mesh, options_.output_layouts(),
                                       options_.use_local_output(), features);
}

void ColwiseParallel::apply_to(torch::nn::Module& module, const DeviceMesh& mesh,
                               std::optional<int64_t> src_data_rank) const {
  auto& hm = detail::sharding_target(*this, module, mesh, src_data_rank);
  const auto kind = hm.module_kind();
  auto self = std::make_shared<ColwiseParallel>(*this);  // the hooks outlive a temporary style
  const int64_t features = detail::output_features(module, kind);
  on_first_input(hm, [self, mesh, kind](const at::Tensor& x) { return self->prepare_input(x, kind, mesh); });
  on_first_output(
      hm, [self, mesh, features](const at::Tensor& y) { return self->prepare_output(y, mesh, features); });
}

// ---- RowwiseParallel ----------------------------------------------------------------------

RowwiseParallel::RowwiseParallel(RowwiseParallelOptions options) : options_(options) {
  check_not_partial("RowwiseParallel", "output_layouts", options_.output_layouts());
}

void RowwiseParallel::check_kind(const ModuleTarget& target, const ModuleTypeNames& names) const {
  check_linear_or_embedding(name(), target, names);
}

void RowwiseParallel::check_target(const ModuleTarget& target, const DeviceMesh&) const {
  if (target.kind == ModuleKind::kLinear) {
    check_not_partial("RowwiseParallel", "input_layouts", options_.input_layouts());
  } else {
    TORCH_CHECK_VALUE(options_.input_layouts().is_replicate(), "RowwiseParallel: expected input_layouts ",
                      "Replicate for an Embedding (ids index the whole vocabulary), got ",
                      options_.input_layouts().str());
  }
}

std::vector<ParameterSharding> RowwiseParallel::parameter_shardings(
    ModuleKind kind, const std::vector<std::string>& parameters) const {
  if (kind == ModuleKind::kEmbedding) return detail::shard_each(parameters, {{"weight", {Shard(0)}}});
  // The bias is added once, after the reduction; a Shard output leaves each rank the bias
  // gradient of its own rows only.
  return detail::shard_each(
      parameters, {{"weight", {Shard(1)}}, {"bias", {Replicate()}, options_.output_layouts().is_shard()}});
}

at::Tensor RowwiseParallel::prepare_input(const at::Tensor& input, const DeviceMesh& mesh) const {
  TORCH_CHECK_VALUE(input.dim() >= 1, "RowwiseParallel: expected an input with a feature dim, got a scalar");
  return detail::prepare(input, mesh, options_.input_layouts(), Shard(input.dim() - 1), true);
}

at::Tensor RowwiseParallel::forward_linear(const at::Tensor& input, const at::Tensor& weight,
                                           const at::Tensor& bias, const DeviceMesh& mesh) const {
  return detail::rowwise_linear(input, weight, bias, mesh, options_.output_layouts(),
                                options_.use_local_output());
}

at::Tensor RowwiseParallel::forward_embedding(const at::Tensor& ids, const at::Tensor& weight,
                                              int64_t vocab_size, const DeviceMesh& mesh,
                                              std::optional<int64_t> padding_idx) const {
  return detail::rowwise_embedding(ids, weight, vocab_size, mesh, options_.output_layouts(),
                                   options_.use_local_output(), padding_idx);
}

void RowwiseParallel::apply_to(torch::nn::Module& module, const DeviceMesh& mesh,
                               std::optional<int64_t> src_data_rank) const {
  const bool embedding = detail::hookable(name().c_str(), module).module_kind() == ModuleKind::kEmbedding;
  const int64_t vocab = embedding ? module.named_parameters(false)["weight"].size(0) : 0;
  auto& hm = detail::sharding_target(*this, module, mesh, src_data_rank);
  auto self = std::make_shared<RowwiseParallel>(*this);  // the hooks outlive a temporary style
  if (embedding) {
    hm.set_forward_kernel(std::make_shared<LinearKernel>(
        "RowwiseEmbedding",
        [self, mesh, vocab](const at::Tensor& ids, const at::Tensor& w, const at::Tensor&) {
          return self->forward_embedding(ids, w, vocab, mesh);
        }));
    return;
  }
  on_first_input(hm, [self, mesh](const at::Tensor& x) { return self->prepare_input(x, mesh); });
  hm.set_forward_kernel(std::make_shared<LinearKernel>(
      "RowwiseLinear", [self, mesh](const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
        return self->forward_linear(x, w, b, mesh);
      }));
}

// ---- SequenceParallel ---------------------------------------------------------------------

std::vector<ParameterSharding> SequenceParallel::parameter_shardings(
    ModuleKind, const std::vector<std::string>& parameters) const {
  std::vector<ParameterSharding> table;
  table.reserve(parameters.size());
  for (const auto& p : parameters) table.push_back({p, {Replicate()}, /*sums_gradient=*/true});
  return table;
}

std::vector<at::Tensor> SequenceParallel::prepare_inputs(std::vector<at::Tensor> inputs,
                                                         const DeviceMesh& mesh) const {
  const int64_t seq_dim = options_.sequence_dim();
  for (auto& x : inputs) {
    if (!x.defined() || !at::isFloatingType(x.scalar_type())) continue;
    TORCH_CHECK_VALUE(seq_dim >= -x.dim() && seq_dim < x.dim(),
                      "SequenceParallel: expected sequence_dim in [", -x.dim(), ", ", x.dim(), ") for a ",
                      x.dim(), "-d input, got ", seq_dim);
    x = detail::prepare(x, mesh, Shard(seq_dim), Shard(seq_dim), true);
  }
  return inputs;
}

at::Tensor SequenceParallel::prepare_output(const at::Tensor& output, const DeviceMesh& mesh) const {
  const auto seq = Shard(options_.sequence_dim());
  return detail::prepare(output, mesh, seq, seq, options_.use_local_output());
}

void SequenceParallel::apply_to(torch::nn::Module& module, const DeviceMesh& mesh,
                                std::optional<int64_t> src_data_rank) const {
  auto& hm = detail::sharding_target(*this, module, mesh, src_data_rank);
  auto self = std::make_shared<SequenceParallel>(*this);  // the hooks outlive a temporary style
  hm.add_input_hook(
      [self, mesh](std::vector<at::Tensor> inputs) { return self->prepare_inputs(std::move(inputs), mesh); });
  on_first_output(hm, [self, mesh](const at::Tensor& y) { return self->prepare_output(y, mesh); });
}

// ---- PrepareModuleInput / PrepareModuleOutput ---------------------------------------------

PrepareModuleInput::PrepareModuleInput(PrepareModuleInputOptions options) : options_(std::move(options)) {
  detail::check_layout_lists("PrepareModuleInput", "input_layouts", options_.input_layouts(),
                             "desired_input_layouts", options_.desired_input_layouts());
}

std::vector<at::Tensor> PrepareModuleInput::prepare_inputs(std::vector<at::Tensor> inputs,
                                                           const DeviceMesh& mesh) const {
  return detail::convert_all("PrepareModuleInput", "inputs", std::move(inputs), mesh,
                             options_.input_layouts(), options_.desired_input_layouts(),
                             options_.use_local_output());
}

void PrepareModuleInput::apply_to(torch::nn::Module& module, const DeviceMesh& mesh,
                                  std::optional<int64_t>) const {
  auto self = std::make_shared<PrepareModuleInput>(*this);  // the hook outlives a temporary style
  detail::hookable("PrepareModuleInput", module).add_input_hook([self, mesh](std::vector<at::Tensor> inputs) {
    return self->prepare_inputs(std::move(inputs), mesh);
  });
}

PrepareModuleOutput::PrepareModuleOutput(PrepareModuleOutputOptions options) : options_(std::move(options)) {
  detail::check_layout_lists("PrepareModuleOutput", "output_layouts", options_.output_layouts(),
                             "desired_output_layouts", options_.desired_output_layouts());
}

std::vector<at::Tensor> PrepareModuleOutput::prepare_outputs(std::vector<at::Tensor> outputs,
                                                             const DeviceMesh& mesh) const {
  return detail::convert_all("PrepareModuleOutput", "outputs", std::move(outputs), mesh,
                             options_.output_layouts(), options_.desired_output_layouts(),
                             options_.use_local_output());
}

void PrepareModuleOutput::apply_to(torch::nn::Module& module, const DeviceMesh& mesh,
                                   std::optional<int64_t>) const {
  auto self = std::make_shared<PrepareModuleOutput>(*this);  // the hook outlives a temporary style
  detail::hookable("PrepareModuleOutput", module)
      .add_output_hook([self, mesh](std::vector<at::Tensor> outputs) {
        return self->prepare_outputs(std::move(outputs), mesh);
      });
}

}  // namespace hyper_parallel::tensor_parallel
