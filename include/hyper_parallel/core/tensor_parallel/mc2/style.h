#pragma once
// MC2ColwiseParallel / MC2RowwiseParallel: ColwiseParallel / RowwiseParallel under sequence
// parallelism with the collective fused into the matmul (mc2/linear.h). Weights are sharded
// exactly as the plain styles shard them; no redistribute to Replicate happens: the fused op
// gathers.

#include <memory>
#include <optional>

#include <torch/arg.h>

#include <hyper_parallel/core/nn/hookable_module.h>
#include <hyper_parallel/core/tensor_parallel/mc2/linear.h>
#include <hyper_parallel/core/tensor_parallel/style.h>

namespace hyper_parallel::tensor_parallel {

/// Usage: MC2ColwiseParallel(MC2ColwiseParallelOptions().input_layouts(Shard(1)))
struct MC2ColwiseParallelOptions {
  /// Must be a Shard (the sequence dim): MC2 requires sequence parallelism.
  TORCH_ARG(dtensor::Placement, input_layouts) = dtensor::Shard(1);
  TORCH_ARG(dtensor::Placement, output_layouts) = dtensor::Shard(-1);
  TORCH_ARG(bool, use_local_output) = true;
  TORCH_ARG(MC2Contract, contract) = MC2Contract::strict();
  TORCH_ARG(MC2Options, mc2_options) = MC2Options();
};

/// What both MC2 styles share: the kind check (an Embedding is not supported, anything else but
/// a Linear is the wrong type), the contract's limits on the module at apply, and the MC2Linear
/// configuration they install.
class MC2Style : public ParallelStyle {
 public:
  void check_kind(const ModuleTarget& target, const ModuleTypeNames& names = {}) const override;
  void check_target(const ModuleTarget& target, const dtensor::DeviceMesh& mesh) const override;

  /// The fused op this style's layers run.
  virtual MC2Mode mc2_mode() const = 0;
  /// The sequence dim MC2Linear is configured with (MC2Linear's convention: a dim of the
  /// leading dims; negative counts from their end), from the style's Shard layout.
  int64_t sequence_dim() const;
  virtual const MC2Contract& contract() const = 0;
  virtual const MC2Options& mc2_options() const = 0;

  /// The input and output hooks (below, per style). `features`: the Linear's out_features, which
  /// a column layer's output split unevenly over the ranks needs (without it the shards are taken
  /// as even); a row layer's output has them whole.
  virtual at::Tensor prepare_input(const at::Tensor& input, const dtensor::DeviceMesh& mesh) const = 0;
  virtual at::Tensor prepare_output(const at::Tensor& output, const dtensor::DeviceMesh& mesh,
                                    std::optional<int64_t> features) const = 0;

 protected:
  /// The Shard(d) layout whose d is the sequence dim.
  virtual const dtensor::Placement& sequence_layout() const = 0;
  /// A copy for the hooks, which outlive a temporary style.
  virtual std::shared_ptr<const MC2Style> clone() const = 0;
  /// Shards the parameters, converts the Linear into a configured MC2Linear and installs the
  /// hooks.
  void apply_to(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                std::optional<int64_t> src_data_rank) const final;
};

class MC2ColwiseParallel : public MC2Style {
 public:
  /// Throws c10::ValueError for layouts MC2 cannot run (a non-Shard or feature-dim input, a
  /// Partial output).
  explicit MC2ColwiseParallel(MC2ColwiseParallelOptions options = {});
  std::string name() const override { return "MC2ColwiseParallel"; }
  const MC2ColwiseParallelOptions& options() const { return options_; }
  MC2Mode mc2_mode() const override { return MC2Mode::kAllGather; }
  const MC2Contract& contract() const override { return options_.contract(); }
  const MC2Options& mc2_options() const override { return options_.mc2_options(); }
  std::vector<ParameterSharding> parameter_shardings(
      nn::ModuleKind kind, const std::vector<std::string>& parameters) const override;

  /// The input hook: the input stays sequence-sharded (the fused op gathers), redistributed to
  /// input_layouts if it is tagged with another layout; the sequence length must divide by the
  /// world size.
  at::Tensor prepare_input(const at::Tensor& input, const dtensor::DeviceMesh& mesh) const override;
  /// The output hook: Shard(-1) (of `features` columns in all) redistributed to output_layouts.
  at::Tensor prepare_output(const at::Tensor& output, const dtensor::DeviceMesh& mesh,
                            std::optional<int64_t> features) const override;

 protected:
  const dtensor::Placement& sequence_layout() const override { return options_.input_layouts(); }
  std::shared_ptr<const MC2Style> clone() const override {
    return std::make_shared<MC2ColwiseParallel>(*this);
  }

 private:
  MC2ColwiseParallelOptions options_;
};

/// Usage: MC2RowwiseParallel(MC2RowwiseParallelOptions().output_layouts(Shard(1)))
struct MC2RowwiseParallelOptions {
  TORCH_ARG(dtensor::Placement, input_layouts) = dtensor::Shard(-1);
  /// Must be a Shard (the sequence dim): MC2 requires sequence parallelism.
  TORCH_ARG(dtensor::Placement, output_layouts) = dtensor::Shard(1);
  TORCH_ARG(bool, use_local_output) = true;
  TORCH_ARG(MC2Contract, contract) = MC2Contract::strict();
  TORCH_ARG(MC2Options, mc2_options) = MC2Options();
};

class MC2RowwiseParallel : public MC2Style {
 public:
  /// Throws c10::ValueError for layouts MC2 cannot run (a non-Shard or feature-dim output, a
  /// Partial input).
  explicit MC2RowwiseParallel(MC2RowwiseParallelOptions options = {});
  std::string name() const override { return "MC2RowwiseParallel"; }
  const MC2RowwiseParallelOptions& options() const { return options_; }
  MC2Mode mc2_mode() const override { return MC2Mode::kReduceScatter; }
  const MC2Contract& contract() const override { return options_.contract(); }
  const MC2Options& mc2_options() const override { return options_.mc2_options(); }
  std::vector<ParameterSharding> parameter_shardings(
      nn::ModuleKind kind, const std::vector<std::string>& parameters) const override;

  /// The input hook: input_layouts redistributed to Shard(-1), the features.
  at::Tensor prepare_input(const at::Tensor& input, const dtensor::DeviceMesh& mesh) const override;
  /// The output hook: the fused op's Shard(sequence) output, tagged unless use_local_output.
  at::Tensor prepare_output(const at::Tensor& output, const dtensor::DeviceMesh& mesh,
                            std::optional<int64_t> features) const override;

 protected:
  const dtensor::Placement& sequence_layout() const override { return options_.output_layouts(); }
  std::shared_ptr<const MC2Style> clone() const override {
    return std::make_shared<MC2RowwiseParallel>(*this);
  }

 private:
  MC2RowwiseParallelOptions options_;
};

}  // namespace hyper_parallel::tensor_parallel
