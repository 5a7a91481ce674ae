#pragma once
// Parallel styles (torch.distributed.tensor.parallel semantics and defaults). A style is applied
// to one module by parallelize_module; it shards the module's parameters over a 1-d mesh and
// hooks its inputs and outputs so that they arrive and leave with the declared layouts.
//
// Between modules, tensors are local shards. use_local_output=false makes a style return its
// output tagged with its layout (DTensor::to_local_tagged), so the next style picks up the
// DTensor itself, as PyTorch's DTensor outputs do; with true the next style reads its
// input_layouts.

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/arg.h>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/dtensor/device_mesh.h>
#include <hyper_parallel/core/dtensor/placement.h>
#include <hyper_parallel/core/nn/hookable_module.h>
#include <hyper_parallel/core/tensor_parallel/parameter_sharding.h>

namespace torch::nn {
class Module;
}

namespace hyper_parallel::tensor_parallel {

/// The type names a style's messages use for the modules it accepts: this library's, or, from
/// the Python front end, torch.nn's (ModuleTypeNames::torch_nn()).
struct ModuleTypeNames {
  std::string linear = "hyper_parallel::nn::Linear";
  std::string embedding = "nn::Embedding";
  static ModuleTypeNames torch_nn() { return {"torch.nn.Linear", "torch.nn.Embedding"}; }
};

/// What a style is about to be applied to, for its checks.
struct ModuleTarget {
  nn::ModuleKind kind = nn::ModuleKind::kOther;
  /// The module's type, for messages ("Linear", "ReLU").
  std::string type;
  /// Its own parameter named "weight": full shape and dtype (empty shape: none).
  std::vector<int64_t> weight_shape;
  at::ScalarType weight_dtype = at::kFloat;
};

/// A module's parameters and forward are changed by one sharding style only: throws a
/// c10::ValueError "<style>: expected a module no style has parallelized yet, got <module_type>
/// already parallelized by <claimed_by>" if `claimed_by` is set.
void check_unclaimed(const std::string& style, const std::string& module_type,
                     const std::optional<std::string>& claimed_by);

class ParallelStyle {
 public:
  virtual ~ParallelStyle() = default;
  /// Applies the style to `module` on a 1-d mesh (the TP mesh; slice a larger one by name).
  /// Throws for modules the style does not support. `src_data_rank` is the TP rank whose
  /// parameter values every rank's shard is cut from (as in distribute_tensor); nullopt: each
  /// rank already holds the full parameters and shards its own copy, with no communication.
  void apply(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
             std::optional<int64_t> src_data_rank = 0) const;
  virtual std::string name() const = 0;

  /// The checks apply makes before it touches anything (lay_out_parameters runs them, for
  /// this library's modules and for the Python front end's torch.nn modules alike).
  ///
  /// Throws unless the style takes a module of `target.kind`: c10::TypeError for a kind it does
  /// not take, c10::NotImplementedError for one it does not support yet; `names` spell the
  /// accepted types. Default: any kind.
  virtual void check_kind(const ModuleTarget& /*target*/, const ModuleTypeNames& /*names*/ = {}) const {}
  /// Throws c10::ValueError unless the style's options and limits fit `target` on `mesh`.
  /// Default: nothing to check.
  virtual void check_target(const ModuleTarget& /*target*/, const dtensor::DeviceMesh& /*mesh*/) const {}
  /// The style's parameter table for a module of `kind` whose own parameters are called
  /// `parameters` (in module order). Default: none.
  virtual std::vector<ParameterSharding> parameter_shardings(
      nn::ModuleKind /*kind*/, const std::vector<std::string>& /*parameters*/) const {
    return {};
  }

 protected:
  /// The style's own work, after apply checked that the mesh is 1-d.
  virtual void apply_to(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                        std::optional<int64_t> src_data_rank) const = 0;
};

/// The apply preamble of a style that lays out a module's parameters, one sequence for every
/// front end (the styles' apply on this library's modules, the Python styles on torch.nn
/// modules), in this order: style.check_kind (its messages spell the accepted types as `names`
/// does), the 1-d mesh (check_tp_mesh), check_unclaimed (`claimed_by`: the style that already
/// changed the module's forward, if any), no parameter laid out already (by another style, or by
/// fully_shard: styles go first), style.check_target; then the style's parameter table applied
/// to `parameters` (the module's own, by name): each sharded in place, its layout recorded. Throws before
/// anything is touched. Returns the names of the parameters whose gradient is Partial: the caller makes the
/// module's forward read each through sum_gradient_on_read (parameter_sharding.h).
std::vector<std::string> lay_out_parameters(const ParallelStyle& style, const ModuleTarget& target,
                                            const std::vector<std::pair<std::string, at::Tensor>>& parameters,
                                            const std::optional<std::string>& claimed_by,
                                            const dtensor::DeviceMesh& mesh,
                                            std::optional<int64_t> src_data_rank,
                                            const ModuleTypeNames& names = {});

/// ColwiseParallel: Linear weight and bias Shard(0), Embedding weight Shard(1); the input is made
/// Replicate (a Shard input is all-gathered; its gradient, Partial, is reduce-scattered); the
/// output is Shard(-1) unless output_layouts says otherwise.
///
/// Usage:
///   ColwiseParallel(ColwiseParallelOptions().input_layouts(Shard(1)))
struct ColwiseParallelOptions {
  TORCH_ARG(dtensor::Placement, input_layouts) = dtensor::Replicate();
  TORCH_ARG(dtensor::Placement, output_layouts) = dtensor::Shard(-1);
  TORCH_ARG(bool, use_local_output) = true;
};

class ColwiseParallel : public ParallelStyle {
 public:
  explicit ColwiseParallel(ColwiseParallelOptions options = {});
  std::string name() const override { return "ColwiseParallel"; }
  const ColwiseParallelOptions& options() const { return options_; }
  void check_kind(const ModuleTarget& target, const ModuleTypeNames& names = {}) const override;
  std::vector<ParameterSharding> parameter_shardings(
      nn::ModuleKind kind, const std::vector<std::string>& parameters) const override;

  /// The input hook: a Linear's input made Replicate (gathered if sharded; its gradient, Partial,
  /// is reduce-scattered), an Embedding's ids made Replicate.
  at::Tensor prepare_input(const at::Tensor& input, nn::ModuleKind kind,
                           const dtensor::DeviceMesh& mesh) const;
  /// The output hook: Shard(-1) redistributed to output_layouts. `features`: the module's whole
  /// output width (a Linear's out_features, an Embedding's embedding_dim), which an uneven split
  /// needs; without it the shards are taken as even.
  at::Tensor prepare_output(const at::Tensor& output, const dtensor::DeviceMesh& mesh,
                            std::optional<int64_t> features = std::nullopt) const;

 protected:
  void apply_to(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                std::optional<int64_t> src_data_rank) const override;

 private:
  ColwiseParallelOptions options_;
};

/// RowwiseParallel: Linear weight Shard(1) with the bias Replicate, added once after the
/// reduction; Embedding weight Shard(0) over the vocabulary with a Replicate input. The local
/// result is Partial: all-reduced to Replicate or reduce-scattered to a Shard output.
///
/// Usage:
///   RowwiseParallel(RowwiseParallelOptions().output_layouts(Shard(1)))
struct RowwiseParallelOptions {
  TORCH_ARG(dtensor::Placement, input_layouts) = dtensor::Shard(-1);
  TORCH_ARG(dtensor::Placement, output_layouts) = dtensor::Replicate();
  TORCH_ARG(bool, use_local_output) = true;
};

class RowwiseParallel : public ParallelStyle {
 public:
  explicit RowwiseParallel(RowwiseParallelOptions options = {});
  std::string name() const override { return "RowwiseParallel"; }
  const RowwiseParallelOptions& options() const { return options_; }
  void check_kind(const ModuleTarget& target, const ModuleTypeNames& names = {}) const override;
  void check_target(const ModuleTarget& target, const dtensor::DeviceMesh& mesh) const override;
  std::vector<ParameterSharding> parameter_shardings(
      nn::ModuleKind kind, const std::vector<std::string>& parameters) const override;

  /// A Linear's input hook: input_layouts redistributed to Shard(-1), the features.
  at::Tensor prepare_input(const at::Tensor& input, const dtensor::DeviceMesh& mesh) const;
  /// A Linear's forward: x @ W_localᵀ is Partial; reduced to output_layouts, then the bias added
  /// once.
  at::Tensor forward_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                            const dtensor::DeviceMesh& mesh) const;
  /// An Embedding's forward over this rank's rows of a `vocab_size` table: ids outside look up
  /// zeros, so the sum over ranks (to output_layouts) is the full lookup. The row `padding_idx`
  /// (of the whole table; negative counts from its end), if given, gets no gradient, as in
  /// torch.nn.Embedding.
  at::Tensor forward_embedding(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_size,
                               const dtensor::DeviceMesh& mesh,
                               std::optional<int64_t> padding_idx = std::nullopt) const;

 protected:
  void apply_to(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                std::optional<int64_t> src_data_rank) const override;

 private:
  RowwiseParallelOptions options_;
};

/// SequenceParallel: for modules that act on each token alone (norms, dropout). Parameters stay
/// replicated; the input is Shard(sequence_dim) (a plain tensor is taken as that shard); no
/// communication in forward. The gradient of each rank's forward covers its own tokens only
/// (Partial): the module reads its parameters through sum_gradient_on_read, which sums that
/// gradient over the mesh in backward (CommRegion "grad_sync") and leaves other gradients of the
/// parameters (a loss term on them) as they are. The module's forward must read its parameters
/// through HookableModule::parameter (this library's modules do); one that does not is an error
/// at its first forward with grad.
///
/// Usage:
///   SequenceParallel(SequenceParallelOptions().sequence_dim(0))
struct SequenceParallelOptions {
  TORCH_ARG(int64_t, sequence_dim) = 1;
  TORCH_ARG(bool, use_local_output) = false;
};

class SequenceParallel : public ParallelStyle {
 public:
  explicit SequenceParallel(SequenceParallelOptions options = {}) : options_(options) {}
  std::string name() const override { return "SequenceParallel"; }
  const SequenceParallelOptions& options() const { return options_; }
  std::vector<ParameterSharding> parameter_shardings(
      nn::ModuleKind kind, const std::vector<std::string>& parameters) const override;

  /// The input hook: every floating input taken as Shard(sequence_dim) (a tagged one is
  /// redistributed to it); other inputs (ids, masks) pass unchanged.
  std::vector<at::Tensor> prepare_inputs(std::vector<at::Tensor> inputs,
                                         const dtensor::DeviceMesh& mesh) const;
  /// The output hook: Shard(sequence_dim), tagged unless use_local_output.
  at::Tensor prepare_output(const at::Tensor& output, const dtensor::DeviceMesh& mesh) const;

 protected:
  void apply_to(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                std::optional<int64_t> src_data_rank) const override;

 private:
  SequenceParallelOptions options_;
};

/// A layout per positional input/output; nullopt leaves that one alone.
using LayoutList = std::vector<std::optional<dtensor::Placement>>;

/// PrepareModuleInput: converts each positional input from input_layouts to
/// desired_input_layouts before the module runs. The two lists must have the same length.
///
/// Usage:
///   PrepareModuleInput(PrepareModuleInputOptions()
///                          .input_layouts({Shard(1), std::nullopt})
///                          .desired_input_layouts({Replicate(), std::nullopt}))
struct PrepareModuleInputOptions {
  TORCH_ARG(LayoutList, input_layouts);
  TORCH_ARG(LayoutList, desired_input_layouts);
  TORCH_ARG(bool, use_local_output) = false;
};

class PrepareModuleInput : public ParallelStyle {
 public:
  /// Throws c10::ValueError unless the two lists have the same length and the same unset
  /// positions.
  explicit PrepareModuleInput(PrepareModuleInputOptions options);
  std::string name() const override { return "PrepareModuleInput"; }
  const PrepareModuleInputOptions& options() const { return options_; }

  /// The input hook: one layout per positional input (a different count is a c10::ValueError).
  std::vector<at::Tensor> prepare_inputs(std::vector<at::Tensor> inputs,
                                         const dtensor::DeviceMesh& mesh) const;

 protected:
  void apply_to(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                std::optional<int64_t> src_data_rank) const override;

 private:
  PrepareModuleInputOptions options_;
};

/// PrepareModuleOutput: converts each output from output_layouts to desired_output_layouts.
struct PrepareModuleOutputOptions {
  TORCH_ARG(LayoutList, output_layouts);
  TORCH_ARG(LayoutList, desired_output_layouts);
  TORCH_ARG(bool, use_local_output) = true;
};

class PrepareModuleOutput : public ParallelStyle {
 public:
  /// Throws c10::ValueError unless the two lists have the same length and the same unset
  /// positions.
  explicit PrepareModuleOutput(PrepareModuleOutputOptions options);
  std::string name() const override { return "PrepareModuleOutput"; }
  const PrepareModuleOutputOptions& options() const { return options_; }

  /// The output hook: one layout per output (a different count is a c10::ValueError).
  std::vector<at::Tensor> prepare_outputs(std::vector<at::Tensor> outputs,
                                          const dtensor::DeviceMesh& mesh) const;

 protected:
  void apply_to(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                std::optional<int64_t> src_data_rank) const override;

 private:
  PrepareModuleOutputOptions options_;
};

}  // namespace hyper_parallel::tensor_parallel
