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
#include <vector>

#include <torch/arg.h>

#include <hyper_parallel/core/dtensor/device_mesh.h>
#include <hyper_parallel/core/dtensor/placement.h>

namespace torch::nn {
class Module;
}

namespace hyper_parallel::tensor_parallel {

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

 protected:
  /// The style's own work, after apply checked that the mesh is 1-d.
  virtual void apply_to(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                        std::optional<int64_t> src_data_rank) const = 0;
};

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
  explicit ColwiseParallel(ColwiseParallelOptions options = {}) : options_(std::move(options)) {}
  std::string name() const override { return "ColwiseParallel"; }
  const ColwiseParallelOptions& options() const { return options_; }

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
  explicit RowwiseParallel(RowwiseParallelOptions options = {}) : options_(std::move(options)) {}
  std::string name() const override { return "RowwiseParallel"; }
  const RowwiseParallelOptions& options() const { return options_; }

 protected:
  void apply_to(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                std::optional<int64_t> src_data_rank) const override;

 private:
  RowwiseParallelOptions options_;
};

/// SequenceParallel: for modules that act on each token alone (norms, dropout). Parameters stay
/// replicated; the input is Shard(sequence_dim) (a plain tensor is taken as that shard); no
/// communication in forward or backward. Each rank's parameter gradient covers its own tokens
/// only (Partial), so a gradient hook sums it over the mesh before any optimizer sees it
/// (recorded in CommRegion "grad_sync").
///
/// Usage:
///   SequenceParallel(SequenceParallelOptions().sequence_dim(0))
struct SequenceParallelOptions {
  TORCH_ARG(int64_t, sequence_dim) = 1;
  TORCH_ARG(bool, use_local_output) = false;
};

class SequenceParallel : public ParallelStyle {
 public:
  explicit SequenceParallel(SequenceParallelOptions options = {}) : options_(std::move(options)) {}
  std::string name() const override { return "SequenceParallel"; }

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
  explicit PrepareModuleInput(PrepareModuleInputOptions options);
  std::string name() const override { return "PrepareModuleInput"; }

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
  explicit PrepareModuleOutput(PrepareModuleOutputOptions options);
  std::string name() const override { return "PrepareModuleOutput"; }

 protected:
  void apply_to(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                std::optional<int64_t> src_data_rank) const override;

 private:
  PrepareModuleOutputOptions options_;
};

}  // namespace hyper_parallel::tensor_parallel
