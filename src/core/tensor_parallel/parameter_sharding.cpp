#include <hyper_parallel/core/tensor_parallel/parameter_sharding.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/counters.h>
#include <hyper_parallel/core/comm/pending_all_reduce.h>
#include <hyper_parallel/core/dtensor/dtensor.h>
#include <hyper_parallel/core/nn/parameter_layout.h>
#include <hyper_parallel/core/nn/pending_gradient.h>
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
  // The hook cannot capture the parameter (a cycle through its own hook list): it keeps a weak
  // reference.
  using WeakParam = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  param.register_hook([group, weak = WeakParam(param.getIntrusivePtr())](const at::Tensor& grad) {
    auto impl = weak.lock();
    if (!impl) return at::Tensor();
    // Started here, finished when someone reads .grad or at the end of the backward
    // (nn::pending_gradient.h): the backward goes on while the sum travels. Every rank of the
    // TP group runs the same backward, so the ranks start these sums in the same order.
    comm::CommRegion region("grad_sync");
    auto sum = grad.detach().clone(at::MemoryFormat::Contiguous);
    auto pending = std::make_shared<comm::PendingAllReduce>(
        comm::start_all_reduce(sum, comm::ReduceOp::kSum, group, comm::Agreement::kAgreedInAdvance));
    nn::defer_gradient(
        at::Tensor(std::move(impl)),
        [pending, sum] {
          pending->wait();
          return sum;
        },
        nn::Contribution::kReplacesPart);
    return at::Tensor();  // AccumulateGrad adds this rank's part until the sum replaces it
  });
}

void check_unclaimed(const std::string& style, const std::string& module_type,
                     const std::optional<std::string>& claimed_by) {
  TORCH_CHECK_VALUE(!claimed_by.has_value(), style, ": expected a module no style has parallelized yet, got ",
                    module_type, " already parallelized by ", claimed_by.value_or(""));
}

}  // namespace hyper_parallel::tensor_parallel
