#pragma once
// MC2ColwiseParallel / MC2RowwiseParallel: ColwiseParallel / RowwiseParallel under sequence
// parallelism with the collective fused into the matmul (mc2/linear.h). Weights are sharded
// exactly as the plain styles shard them; no redistribute to Replicate happens: the fused op
// gathers.

#include <torch/arg.h>

#include <hyper_parallel/core/tensor_parallel/mc2/linear.h>
#include <hyper_parallel/core/tensor_parallel/style.h>
#include <hyper_parallel/core/nn/hookable_module.h>

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

class MC2ColwiseParallel : public ParallelStyle {
 public:
  explicit MC2ColwiseParallel(MC2ColwiseParallelOptions options = {});
  std::string name() const override { return "MC2ColwiseParallel"; }
  const MC2ColwiseParallelOptions& options() const { return options_; }
  /// The contract's checks for a module of `kind` (named `module_name`) whose full weight has
  /// `weight_shape` and `dtype`, on `mesh`; `linear_name` names the expected type in messages.
  /// Throws c10::NotImplementedError for an Embedding, c10::TypeError for another non-Linear and
  /// c10::ValueError for a limit (world size, dtype, contraction dims for every rank's shard),
  /// before anything is touched. apply runs it; the Python front end runs it on torch.nn modules.
  void check_target(nn::ModuleKind kind, const std::string& module_name, const char* linear_name,
                    c10::IntArrayRef weight_shape, at::ScalarType dtype,
                    const dtensor::DeviceMesh& mesh) const;

 protected:
  void apply_to(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                std::optional<int64_t> src_data_rank) const override;

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

class MC2RowwiseParallel : public ParallelStyle {
 public:
  explicit MC2RowwiseParallel(MC2RowwiseParallelOptions options = {});
  std::string name() const override { return "MC2RowwiseParallel"; }
  const MC2RowwiseParallelOptions& options() const { return options_; }
  /// The contract's checks for a module of `kind` (named `module_name`) whose full weight has
  /// `weight_shape` and `dtype`, on `mesh`; `linear_name` names the expected type in messages.
  /// Throws c10::NotImplementedError for an Embedding, c10::TypeError for another non-Linear and
  /// c10::ValueError for a limit (world size, dtype, contraction dims for every rank's shard),
  /// before anything is touched. apply runs it; the Python front end runs it on torch.nn modules.
  void check_target(nn::ModuleKind kind, const std::string& module_name, const char* linear_name,
                    c10::IntArrayRef weight_shape, at::ScalarType dtype,
                    const dtensor::DeviceMesh& mesh) const;

 protected:
  void apply_to(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                std::optional<int64_t> src_data_rank) const override;

 private:
  MC2RowwiseParallelOptions options_;
};

}  // namespace hyper_parallel::tensor_parallel
