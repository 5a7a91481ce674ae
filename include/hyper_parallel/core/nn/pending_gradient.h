#pragma once
// Gradient contributions still in flight. A parameter whose gradient each rank holds only in
// part (a sequence-parallel norm's weight: each rank's covers its own tokens) is summed over its
// group; the sum starts when autograd produces the rank's part and the backward goes on while it
// travels. The sum replaces the part in the parameter's .grad when it is finished (fully_shard's
// reduced gradients travel the same way, added to .grad: Contribution::kAdds):
//   - by whoever reads .grad during the backward (a data-parallel reducer, before it copies the
//     gradient into a bucket): finish_gradient(param);
//   - for every parameter still pending, at the end of the backward (the autograd engine's final
//     callback), so .grad is complete when backward() returns.
// A backward that fails part-way waits for the sums it started and drops them. Everything here
// runs on the thread that runs the backward.

#include <functional>

#include <ATen/core/Tensor.h>

namespace hyper_parallel::nn {

/// Blocks until a contribution's transfer is done; returns the tensor that .grad must hold in
/// place of the rank's part (the sum of every rank's part), or an undefined one: no rank had a
/// part, and .grad stays as it is (no hook runs).
using WaitForGradient = std::function<at::Tensor()>;

/// How a finished contribution reaches .grad.
enum class Contribution {
  /// The sum replaces the rank's part, which AccumulateGrad adds after the hook that defers it:
  /// .grad becomes what it held before that hook plus the sum (a sequence-parallel norm's weight).
  kReplacesPart,
  /// Added to what .grad holds when it finishes, other gradients of the parameter in this backward
  /// included (a loss term on the parameter itself): fully_shard's reduced gradient, which no
  /// AccumulateGrad of the parameter carries.
  kAdds,
};

/// Called during the backward (for kReplacesPart, by a gradient hook of `param`, before
/// AccumulateGrad adds the rank's part to .grad): records the contribution in flight, and
/// registers the end-of-backward finish once per backward. When finished, the waited tensor
/// reaches .grad as `how` says, with the same rounding as if AccumulateGrad had added it.
/// `run_hooks`: for a parameter that autograd does not reach in this backward (fully_shard's
/// reduced gradient of a parameter the backward skipped): its gradient hooks see the waited
/// tensor before it is added, as they would in its AccumulateGrad; not run for a contribution
/// that a failed backward drops.
void defer_gradient(const at::Tensor& param, WaitForGradient wait, Contribution how, bool run_hooks = false);

/// Finishes `param`'s contribution in flight, if any (waits for it, then fixes .grad).
void finish_gradient(const at::Tensor& param);

/// Finishes every contribution in flight.
void finish_all_gradients();

}  // namespace hyper_parallel::nn
