#include "deferred_weight_grad.h"

#include <exception>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/trace.h>

#include "../../autograd/attach_backward.h"
#include "../../autograd/weight_grad_scheduler.h"

namespace hyper_parallel::tensor_parallel::detail {

void DeferredWeightGrad::post(Job job) {
  // A graph kept with retain_graph runs its backward again. A job its last pass left unrun
  // (autograd::grad not asking for this weight, a failed pass) is dropped: this one replaces it.
  job_ = std::move(job);
  result_.clear();
  error_ = nullptr;
  done_ = false;
  hyper_parallel::detail::WeightGradScheduler::of_this_thread().post(shared_from_this());
}

void DeferredWeightGrad::run() {
  if (done_ || !job_) return;
  comm::trace::Span span("wgrad");
  // A failure (out of memory) must not escape into the collective whose window this is, with
  // its receives posted: it is kept and raised by take(), in this weight's own node.
  try {
    result_ = job_();
  } catch (...) {
    error_ = std::current_exception();
  }
  job_ = nullptr;  // releases dY and X
  done_ = true;
}

std::vector<at::Tensor> DeferredWeightGrad::take() {
  TORCH_INTERNAL_ASSERT(job_ || done_, "DeferredWeightGrad::take: delivered before its job was posted");
  run();
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  return std::move(result_);
}

at::Tensor deliver_weight_grad(const std::shared_ptr<DeferredWeightGrad>& slot, const at::Tensor& w,
                               const at::Tensor& bias, uint64_t host_sequence_nr) {
  auto token = at::empty({0}, w.options());
  // Below the host: among ready nodes the engine runs the highest number first.
  const uint64_t sequence_nr = host_sequence_nr == 0 ? 0 : host_sequence_nr - 1;
  return hyper_parallel::detail::attach_backward(
      {w, bias}, {token}, [slot](const std::vector<at::Tensor>&) { return slot->take(); },
      "MC2DeferredWeightGrad",
      /*materialize_grads=*/false, sequence_nr)[0];
}

}  // namespace hyper_parallel::tensor_parallel::detail
