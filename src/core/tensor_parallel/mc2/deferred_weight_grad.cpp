#include "deferred_weight_grad.h"

#include <algorithm>
#include <deque>
#include <exception>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>

#include <hyper_parallel/core/comm/trace.h>

#include "../../autograd/attach_backward.h"

namespace hyper_parallel::tensor_parallel::detail {
namespace {

// Jobs posted on this thread and not yet known to have run; weak, so that a pass freed with
// jobs unrun (a failed backward, torch.autograd.grad not asking for the weights) drops them.
thread_local std::deque<std::weak_ptr<DeferredWeightGrad>> posted;
thread_local std::weak_ptr<torch::autograd::Node> host_node;

}  // namespace

void DeferredWeightGrad::post(Job job) {
  // A graph kept with retain_graph runs its backward again. A job its last pass left unrun
  // (autograd::grad not asking for this weight, a failed pass) is dropped: this one replaces it.
  job_ = std::move(job);
  result_.clear();
  error_ = nullptr;
  done_ = false;
  // Entries already run or freed are dropped first, so a thread no window drains keeps none,
  // and so is this slot's own entry from a pass that left it unrun: one entry per slot.
  posted.erase(std::remove_if(posted.begin(), posted.end(),
                              [this](const std::weak_ptr<DeferredWeightGrad>& entry) {
                                auto slot = entry.lock();
                                return !slot || slot->done() || slot.get() == this;
                              }),
               posted.end());
  posted.push_back(weak_from_this());
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

void run_deferred_weight_grads() {
  while (!posted.empty()) {
    auto slot = posted.front().lock();
    posted.pop_front();
    if (slot) slot->run();
  }
}

void remember_gather_host(const at::Tensor& row_output) {
  host_node = row_output.defined() ? row_output.grad_fn() : nullptr;
}

std::optional<uint64_t> gather_host() {
  auto node = host_node.lock();
  // A host whose backward has run (a graph the caller keeps alive from an earlier pass) has no
  // window left to offer.
  if (!node || hyper_parallel::detail::backward_released(*node)) return std::nullopt;
  return node->sequence_nr();
}

at::Tensor deliver_weight_grad(const std::shared_ptr<DeferredWeightGrad>& slot, const at::Tensor& w,
                               const at::Tensor& bias, uint64_t host_sequence_nr) {
  auto token = at::empty({0}, w.options());
  // Below the host: among ready nodes the engine runs the highest number first.
  const uint64_t sequence_nr = host_sequence_nr == 0 ? 0 : host_sequence_nr - 1;
  return hyper_parallel::detail::attach_backward(
      {w, bias}, {token}, [slot](std::vector<at::Tensor>) { return slot->take(); }, "MC2DeferredWeightGrad",
      /*materialize_grads=*/false, sequence_nr)[0];
}

}  // namespace hyper_parallel::tensor_parallel::detail
