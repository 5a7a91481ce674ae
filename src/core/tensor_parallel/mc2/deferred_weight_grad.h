#pragma once
// Internal: weight gradients whose GEMM runs in a later backward gather's window.
//
// A row Linear's dW = dY_fullᵀ X needs every gathered dY row, so it cannot hide behind its own
// gather; a layer sharing a gather (wk, wv beside wq; w3 beside w1) has no collective of its
// own. Both post their dW (and the bias's sum) as a window job (autograd/weight_grad_scheduler.h) to the
// gather host recorded last before them in forward; the column backwards keep their
// reduce-scatter windows for their own dW. A delivery node per layer hands each result to
// autograd, so the weight's AccumulateGrad, its hooks and gradient reducers see it as usual. It
// is numbered just below the host's node (autograd runs the ready node with the highest sequence
// number first), so it runs after the host, and it computes the job itself if no window ran it:
// the same GEMM on the same tensors either way, so gradients are bitwise those of the serial
// order (except for a weight used three or more times in one pass, whose parts may then reach
// its accumulator in another order). Everything here runs on the thread that runs the backward:
// the CPU engine runs every node on the caller's thread (a device engine would not, and the
// slots have no locks).

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "../../autograd/weight_grad_scheduler.h"

namespace hyper_parallel::tensor_parallel::detail {

/// One layer's deferred {weight, bias} gradients.
class DeferredWeightGrad : public hyper_parallel::detail::WeightGradJob,
                           public std::enable_shared_from_this<DeferredWeightGrad> {
 public:
  using Job = std::function<std::vector<at::Tensor>()>;

  /// By the backward node that has dY: queues `job` on this thread for the next window.
  void post(Job job);
  /// Runs the job unless it has run; a failure is kept for take().
  void run() override;
  /// By the delivery node: the result (running the job now if no window did), released here.
  std::vector<at::Tensor> take();
  bool done() const override { return done_; }

 private:
  Job job_;
  std::vector<at::Tensor> result_;
  std::exception_ptr error_;  // the job's failure, raised by take()
  bool done_ = false;
};

/// A token tensor whose autograd node delivers `slot`'s result as the gradients of {w, bias},
/// scheduled after the node numbered `host_sequence_nr`. The posting node takes the token as an
/// input, so the delivery node runs after it.
at::Tensor deliver_weight_grad(const std::shared_ptr<DeferredWeightGrad>& slot, const at::Tensor& w,
                               const at::Tensor& bias, uint64_t host_sequence_nr);

}  // namespace hyper_parallel::tensor_parallel::detail
