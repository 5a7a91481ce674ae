#include <hyper_parallel/core/tensor_parallel/parameter_sharding.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/counters.h>
#include <hyper_parallel/core/comm/pending_all_reduce.h>
#include <hyper_parallel/core/dtensor/dtensor.h>
#include <hyper_parallel/core/nn/parameter_layout.h>
#include <hyper_parallel/core/nn/pending_gradient.h>
#include <hyper_parallel/core/tensor_parallel/style.h>

#include "../autograd/attach_backward.h"
#include "../autograd/unobserved.h"

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

namespace {

using WeakParam = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// Whether the gradient of `param` reaches .grad with no one reading it on the way: no gradient
// hook, and the current backward accumulates it without a capture (autograd.grad(..., inputs)).
// Only then may its sum join .grad after the backward went on.
bool accumulates_unobserved(const at::Tensor& param) {
  if (!torch::autograd::impl::hooks(param).empty()) return false;
  const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(param);
  return accumulator != nullptr && hyper_parallel::detail::runs_unobserved(*accumulator);
}

}  // namespace

at::Tensor sum_gradient_on_read(const at::Tensor& read, const dtensor::DeviceMesh& mesh) {
  if (mesh.size(0) == 1 || !read.requires_grad() || !torch::autograd::GradMode::is_enabled()) return read;
  // The node cannot hold the parameter (a cycle through its own graph): a weak reference.
  std::optional<WeakParam> param;
  if (read.is_leaf()) param.emplace(read.getIntrusivePtr());
  auto backward = [group = mesh.get_group(0), param](std::vector<at::Tensor> grads) {
    if (!grads[0].defined()) return std::vector<at::Tensor>{at::Tensor()};
    TORCH_CHECK_NOT_IMPLEMENTED(
        !torch::autograd::GradMode::is_enabled(),
        "sum_gradient_on_read: expected a backward without create_graph (the sum over "
        "the mesh of a sequence-parallel parameter's gradient is not differentiable), "
        "got create_graph=True");
    comm::CommRegion region("grad_sync");
    auto sum = grads[0].detach().clone(at::MemoryFormat::Contiguous);
    auto pending = std::make_shared<comm::PendingAllReduce>(
        comm::start_all_reduce(sum, comm::ReduceOp::kSum, group, comm::Agreement::kAgreedInAdvance));
    const auto leaf = param ? at::Tensor(param->lock()) : at::Tensor();
    if (leaf.defined() && accumulates_unobserved(leaf)) {
      // Added to .grad when finished (nn::pending_gradient.h): the backward goes on meanwhile.
      nn::defer_gradient(leaf, [pending, sum] {
        pending->wait();
        return sum;
      });
      return std::vector<at::Tensor>{at::Tensor()};
    }
    pending->wait();
    return std::vector<at::Tensor>{sum};
  };
  return hyper_parallel::detail::attach_backward({read}, {read.detach()}, std::move(backward),
                                                 "SumGradientOnReadBackward", /*materialize_grads=*/false)[0];
}

void check_unclaimed(const std::string& style, const std::string& module_type,
                     const std::optional<std::string>& claimed_by) {
  TORCH_CHECK_VALUE(!claimed_by.has_value(), style, ": expected a module no style has parallelized yet, got ",
                    module_type, " already parallelized by ", claimed_by.value_or(""));
}

}  // namespace hyper_parallel::tensor_parallel
