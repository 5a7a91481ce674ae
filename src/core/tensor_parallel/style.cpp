#include <hyper_parallel/core/tensor_parallel/style.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/counters.h>
#include <hyper_parallel/core/dtensor/dtensor.h>
#include <hyper_parallel/core/tensor_parallel/parallelize.h>
#include <hyper_parallel/core/nn/hookable_module.h>

#include "style_common.h"

namespace hyper_parallel::tensor_parallel {

using dtensor::DeviceMesh;
using dtensor::DTensor;
using dtensor::Partial;
using dtensor::Placement;
using dtensor::Placements;
using dtensor::Replicate;
using dtensor::Shard;

void ParallelStyle::apply(torch::nn::Module& module, const DeviceMesh& mesh,
                          std::optional<int64_t> src_data_rank) const {
  const auto style = name();
  check_tp_mesh(style.c_str(), mesh);
  apply_to(module, mesh, src_data_rank);
  if (auto* hm = dynamic_cast<nn::HookableModule*>(&module)) hm->add_applied_style(style);
}

namespace {

using detail::hookable;
using nn::ModuleKind;

// RowwiseParallel's forward kernels (style_common): reduce the Partial result, then the bias.
class RowwiseLinearKernel final : public nn::ForwardKernel {
 public:
  RowwiseLinearKernel(DeviceMesh mesh, Placement output, bool use_local_output)
      : mesh_(std::move(mesh)), output_(output), use_local_output_(use_local_output) {}
  at::Tensor forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) override {
    return detail::rowwise_linear(x, weight, bias, mesh_, output_, use_local_output_);
  }
  std::string name() const override { return "RowwiseLinear"; }

 private:
  DeviceMesh mesh_;
  Placement output_;
  bool use_local_output_;
};

class RowwiseEmbeddingKernel final : public nn::ForwardKernel {
 public:
  RowwiseEmbeddingKernel(DeviceMesh mesh, int64_t vocab, Placement output, bool use_local_output)
      : mesh_(std::move(mesh)), vocab_(vocab), output_(output), use_local_output_(use_local_output) {}
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& weight, const at::Tensor&) override {
    return detail::rowwise_embedding(ids, weight, vocab_, mesh_, output_, use_local_output_);
  }
  std::string name() const override { return "RowwiseEmbedding"; }

 private:
  DeviceMesh mesh_;
  int64_t vocab_;
  Placement output_;
  bool use_local_output_;
};

const detail::ModuleKinds kLinearOrEmbedding{{ModuleKind::kLinear, ModuleKind::kEmbedding},
                                              "hyper_parallel::nn::Linear or nn::Embedding",
                                              "only those are supported"};

}  // namespace

void ColwiseParallel::apply_to(torch::nn::Module& module, const DeviceMesh& mesh,
                           std::optional<int64_t> src_data_rank) const {
  auto& hm = detail::sharding_target("ColwiseParallel", module, kLinearOrEmbedding);
  const auto in = options_.input_layouts(), out = options_.output_layouts();
  TORCH_CHECK(!in.is_partial(), "ColwiseParallel: expected input_layouts Shard or Replicate, got ",
              in.str());
  TORCH_CHECK(!out.is_partial(), "ColwiseParallel: expected output_layouts Shard or Replicate, got ",
              out.str());
  if (hm.module_kind() == ModuleKind::kLinear) {
    detail::shard_parameter(module, "weight", mesh, {Shard(0)}, src_data_rank);
    if (module.named_parameters(false).contains("bias")) {
      detail::shard_parameter(module, "bias", mesh, {Shard(0)}, src_data_rank);
    }
    // Replicate input; its gradient out of the column-sharded matmul is Partial.
    hm.add_input_hook([mesh, in](std::vector<at::Tensor> inputs) {
      inputs[0] = detail::replicate_for_column(inputs[0], mesh, in);
      return inputs;
    });
  } else {
    detail::shard_parameter(module, "weight", mesh, {Shard(1)}, src_data_rank);
    hm.add_input_hook([mesh, in](std::vector<at::Tensor> inputs) {
      inputs[0] = detail::prepare(inputs[0], mesh, in, Replicate(), true);
      return inputs;
    });
  }
  detail::add_output_hook(hm, mesh, Shard(-1), out, options_.use_local_output());
}

void RowwiseParallel::apply_to(torch::nn::Module& module, const DeviceMesh& mesh,
                           std::optional<int64_t> src_data_rank) const {
  auto& hm = detail::sharding_target("RowwiseParallel", module, kLinearOrEmbedding);
  const auto in = options_.input_layouts(), out = options_.output_layouts();
  TORCH_CHECK(!out.is_partial(), "RowwiseParallel: expected output_layouts Shard or Replicate, got ",
              out.str());
  if (hm.module_kind() == ModuleKind::kLinear) {
    TORCH_CHECK(!in.is_partial(), "RowwiseParallel: expected input_layouts Shard or Replicate, got ",
                in.str());
    detail::shard_parameter(module, "weight", mesh, {Shard(1)}, src_data_rank);
    if (module.named_parameters(false).contains("bias")) {
      // A Shard output leaves each rank the bias gradient of its own rows only.
      if (out.is_shard()) {
        detail::sync_partial_gradient(module, "bias", mesh, src_data_rank);
      } else {
        detail::shard_parameter(module, "bias", mesh, {Replicate()}, src_data_rank);
      }
    }
    hm.add_input_hook([mesh, in](std::vector<at::Tensor> inputs) {
      TORCH_CHECK(inputs[0].dim() >= 1, "RowwiseParallel: expected an input with a feature dim, got a scalar");
      inputs[0] = detail::prepare(inputs[0], mesh, in, Shard(inputs[0].dim() - 1), true);
      return inputs;
    });
    hm.set_forward_kernel(std::make_shared<RowwiseLinearKernel>(mesh, out, options_.use_local_output()));
  } else {
    TORCH_CHECK(in.is_replicate(), "RowwiseParallel: expected input_layouts Replicate for an ",
                "Embedding (ids index the whole vocabulary), got ", in.str());
    const int64_t vocab = module.named_parameters(false)["weight"].size(0);
    detail::shard_parameter(module, "weight", mesh, {Shard(0)}, src_data_rank);
    hm.set_forward_kernel(
        std::make_shared<RowwiseEmbeddingKernel>(mesh, vocab, out, options_.use_local_output()));
  }
}

void SequenceParallel::apply_to(torch::nn::Module& module, const DeviceMesh& mesh,
                           std::optional<int64_t> src_data_rank) const {
  auto& hm = detail::sharding_target("SequenceParallel", module,
                                     {{}, "a module of this library", "any kind"});
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    detail::sync_partial_gradient(module, item.key(), mesh, src_data_rank);
  }
  const int64_t seq_dim = options_.sequence_dim();
  hm.add_input_hook([mesh, seq_dim](std::vector<at::Tensor> inputs) {
    for (auto& x : inputs) {
      if (!x.defined() || !at::isFloatingType(x.scalar_type())) continue;
      TORCH_CHECK(seq_dim >= -x.dim() && seq_dim < x.dim(), "SequenceParallel: expected sequence_dim in [",
                  -x.dim(), ", ", x.dim(), ") for a ", x.dim(), "-d input, got ", seq_dim);
      x = detail::prepare(x, mesh, Shard(seq_dim), Shard(seq_dim), true);
    }
    return inputs;
  });
  detail::add_output_hook(hm, mesh, Shard(seq_dim), Shard(seq_dim), options_.use_local_output());
}

namespace {

void check_layout_lists(const char* style, const char* a_name, const LayoutList& a,
                        const char* b_name, const LayoutList& b) {
  TORCH_CHECK(a.size() == b.size(), style, ": expected ", a_name, " and ", b_name,
              " of the same length, got ", a.size(), " and ", b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    TORCH_CHECK(a[i].has_value() == b[i].has_value(), style, ": expected ", a_name, "[", i,
                "] and ", b_name, "[", i, "] both set or both left alone (nullopt)");
  }
}

std::vector<at::Tensor> convert_all(const char* style, const char* what, std::vector<at::Tensor> xs,
                                    const DeviceMesh& mesh, const LayoutList& from,
                                    const LayoutList& to, bool use_local_output) {
  TORCH_CHECK(xs.size() == from.size(), style, ": expected ", from.size(), " ", what, " (one per ",
              "layout), got ", xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    if (!from[i] || !xs[i].defined()) continue;
    xs[i] = detail::prepare(xs[i], mesh, *from[i], *to[i], use_local_output);
  }
  return xs;
}

}  // namespace

PrepareModuleInput::PrepareModuleInput(PrepareModuleInputOptions options) : options_(std::move(options)) {
  check_layout_lists("PrepareModuleInput", "input_layouts", options_.input_layouts(),
                     "desired_input_layouts", options_.desired_input_layouts());
}

void PrepareModuleInput::apply_to(torch::nn::Module& module, const DeviceMesh& mesh,
                           std::optional<int64_t> src_data_rank) const {
  auto& hm = hookable("PrepareModuleInput", module);
  hm.add_input_hook([mesh, opts = options_](std::vector<at::Tensor> inputs) {
    return convert_all("PrepareModuleInput", "inputs", std::move(inputs), mesh, opts.input_layouts(),
                       opts.desired_input_layouts(), opts.use_local_output());
  });
}

PrepareModuleOutput::PrepareModuleOutput(PrepareModuleOutputOptions options)
    : options_(std::move(options)) {
  check_layout_lists("PrepareModuleOutput", "output_layouts", options_.output_layouts(),
                     "desired_output_layouts", options_.desired_output_layouts());
}

void PrepareModuleOutput::apply_to(torch::nn::Module& module, const DeviceMesh& mesh,
                           std::optional<int64_t> src_data_rank) const {
  auto& hm = hookable("PrepareModuleOutput", module);
  hm.add_output_hook([mesh, opts = options_](std::vector<at::Tensor> outputs) {
    return convert_all("PrepareModuleOutput", "outputs", std::move(outputs), mesh,
                       opts.output_layouts(), opts.desired_output_layouts(), opts.use_local_output());
  });
}

}  // namespace hyper_parallel::tensor_parallel
