#pragma once
// Internal: weight gradients whose GEMM runs in a later row backward's gather window.
//
// A row Linear's dW = dY_fullᵀ X needs every gathered dY row, so it cannot hide behind its own
// gather; a layer sharing a gather (wk, wv beside wq; w3 beside w1) has no collective of its
// own. Both post their dW (and the bias's sum) as a job instead of computing it. The next row
// backward of the pass (the row Linear recorded last before them in forward: for Llama, w2's
// and w3's go to wo's gather, wo's, wk's and wv's to the previous layer's w2) runs the posted
// jobs while its gather's last chunks travel; the column backwards keep their reduce-scatter
// windows for their own dW. A delivery node per layer hands each result to autograd, so the
// weight's AccumulateGrad, its hooks and gradient reducers see it as usual. It is numbered just
// below the host row's node (autograd runs the ready node with the highest sequence number
// first), so it runs after the host, and it computes the job itself if no window ran it: the
// same GEMM on the same tensors either way, so gradients are bitwise those of the serial order
// (except for a weight used three or more times in one pass, whose parts may then reach its
// accumulator in another order). Everything here runs on the thread that runs the backward:
// the CPU engine runs every node on the caller's thread (a device engine would not, and the
// slots have no locks).

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace hyper_parallel::tensor_parallel::detail {

/// One layer's deferred {weight, bias} gradients.
class DeferredWeightGrad : public std::enable_shared_from_this<DeferredWeightGrad> {
 public:
  using Job = std::function<std::vector<at::Tensor>()>;

  /// By the backward node that has dY: queues `job` on this thread for the next window.
  void post(Job job);
  /// Runs the job unless it has run.
  void run();
  /// By the delivery node: the result (running the job now if no window did), released here.
  std::vector<at::Tensor> take();
  bool done() const { return done_; }

 private:
  Job job_;
  std::vector<at::Tensor> result_;
  std::exception_ptr error_;  // the job's failure, raised by take()
  bool done_ = false;
};

/// Runs every job posted on this thread that has not run: a row backward calls it while its
/// gather's last chunks travel. Jobs whose pass was freed unrun are dropped.
void run_deferred_weight_grads();

/// Remembers the row Linear whose gather window the weight gradients of the layers recorded
/// next on this thread defer into.
void remember_gather_host(const at::Tensor& row_output);
/// That host's sequence number while its node is alive; none otherwise.
std::optional<uint64_t> gather_host();

/// A token tensor whose autograd node delivers `slot`'s result as the gradients of {w, bias},
/// scheduled after the node numbered `host_sequence_nr`. The posting node takes the token as an
/// input, so the delivery node runs after it.
at::Tensor deliver_weight_grad(const std::shared_ptr<DeferredWeightGrad>& slot, const at::Tensor& w,
                               const at::Tensor& bias, uint64_t host_sequence_nr);

}  // namespace hyper_parallel::tensor_parallel::detail
