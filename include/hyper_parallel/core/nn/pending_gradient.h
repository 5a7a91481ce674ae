#pragma once
// Gradient contributions still in flight, added to a parameter's .grad when finished: a
// sequence-parallel norm's weight gradient summed over its group (each rank's covers its own
// tokens), fully_shard's reduced gradients. The transfer starts when autograd produces the
// gradient and the backward goes on while it travels. Each is added to .grad, after whatever
// else the parameter's AccumulateGrad added in this backward (a loss term on the parameter):
//   - by whoever reads .grad during the backward (a data-parallel reducer, before it copies the
//     gradient into a bucket): finish_gradient(param);
//   - for every parameter still pending, at the end of the backward (the autograd engine's final
//     callback), so .grad is complete when backward() returns.
// A backward that fails part-way waits for the sums it started and drops them (running their
// OnDropped). Everything here runs on the thread that runs the backward.

#include <functional>

#include <ATen/core/Tensor.h>

namespace hyper_parallel::nn {

/// Blocks until a contribution's transfer is done; returns the tensor to add to .grad (e.g. the
/// sum of every rank's part), or an undefined one: no rank had a part, and .grad stays as it is
/// (no hook runs).
using WaitForGradient = std::function<at::Tensor()>;

/// Runs, after the wait, when a failed backward drops a contribution (e.g. puts back sums that
/// the transfer took from where they were held, so a retried backward finds them).
using OnDropped = std::function<void()>;

/// Called during the backward: records the contribution in flight, and registers the
/// end-of-backward finish once per backward. When finished, the waited tensor is added to .grad
/// with the same rounding as if AccumulateGrad had added it. `run_hooks`: for a parameter that
/// autograd does not reach in this backward (fully_shard's reduced gradient of a parameter the
/// backward skipped): its gradient hooks see the waited tensor before it is added, as they would
/// in its AccumulateGrad; not run for a contribution that a failed backward drops.
void defer_gradient(const at::Tensor& param, WaitForGradient wait, bool run_hooks = false,
                    OnDropped dropped = {});

/// A contribution in flight that is not added to .grad: `complete` takes the waited tensor when
/// it would be added (at the end of the backward, or by finish_gradient), e.g. to hold it for a
/// later reduction; a failed backward runs `dropped` instead.
void defer_completion(const at::Tensor& param, WaitForGradient wait,
                      std::function<void(const at::Tensor&)> complete, OnDropped dropped = {});

/// Finishes `param`'s contribution in flight, if any (waits for it, then fixes .grad).
void finish_gradient(const at::Tensor& param);

/// Finishes every contribution in flight.
void finish_all_gradients();

}  // namespace hyper_parallel::nn
