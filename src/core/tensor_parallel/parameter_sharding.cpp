#include <hyper_parallel/core/tensor_parallel/parameter_sharding.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/counters.h>
#include <hyper_parallel/core/dtensor/dtensor.h>
#include <hyper_parallel/core/nn/parameter_layout.h>
#include <hyper_parallel/core/tensor_parallel/style.h>

namespace hyper_parallel::tensor_parallel {

void shard_parameter_in_place(const at::Tensor& param, const dtensor::DeviceMesh& mesh,
                              const dtensor::Placements& placements, std::optional<int64_t> src_data_rank) {
  const auto global_shape = param.sizes().vec();
  auto local = dtensor::distribute_tensor(param.detach(), mesh, placements, src_data_rank).to_local();
  {
    at::NoGradGuard no_grad;
    // set_data keeps the parameter object (and an optimizer's reference to it) valid.
    param.set_data(local.contiguous());
  }
  nn::record_layout(param, {mesh, placements, global_shape});
}

void sum_gradient_over_mesh(const at::Tensor& param, const dtensor::DeviceMesh& mesh) {
  if (mesh.size(0) == 1 || !param.requires_grad()) return;
  auto group = mesh.get_group(0);
  param.register_hook([group](const at::Tensor& grad) {
    comm::CommRegion region("grad_sync");
    return comm::all_reduce(grad, comm::ReduceOp::kSum, group);
  });
}

void check_unclaimed(const std::string& style, const std::string& module_type,
                     const std::optional<std::string>& claimed_by) {
  TORCH_CHECK_VALUE(!claimed_by.has_value(), style, ": expected a module no style has parallelized yet, got ",
                    module_type, " already parallelized by ", claimed_by.value_or(""));
}

}  // namespace hyper_parallel::tensor_parallel
