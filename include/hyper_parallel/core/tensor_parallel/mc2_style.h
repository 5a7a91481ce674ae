#pragma once
// MC2ColwiseParallel / MC2RowwiseParallel: ColwiseParallel / RowwiseParallel under sequence
// parallelism with the collective fused into the matmul (mc2_linear.h). Weights are sharded
// exactly as the plain styles shard them; no redistribute to Replicate happens: the fused op
// gathers.

#include <torch/arg.h>

#include <hyper_parallel/core/tensor_parallel/mc2_linear.h>
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

class MC2ColwiseParallel : public ParallelStyle {
 public:
  explicit MC2ColwiseParallel(MC2ColwiseParallelOptions options = {});
  std::string name() const override { return "MC2ColwiseParallel"; }

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

 protected:
  void apply_to(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                std::optional<int64_t> src_data_rank) const override;

 private:
  MC2RowwiseParallelOptions options_;
};

}  // namespace hyper_parallel::tensor_parallel
