#include "weight_grad_scheduler.h"

#include <algorithm>

#include <torch/csrc/autograd/function.h>

#include "attach_backward.h"

namespace hyper_parallel::detail {

WeightGradScheduler& WeightGradScheduler::of_this_thread() {
  thread_local WeightGradScheduler scheduler;
  return scheduler;
}

void WeightGradScheduler::post(const std::shared_ptr<WeightGradJob>& job) {
  // Entries already run or freed are dropped first, so a thread no window drains keeps none, and
  // so is this job's own entry from a pass that left it unrun: one entry per job.
  posted_.erase(std::remove_if(posted_.begin(), posted_.end(),
                               [&](const std::weak_ptr<WeightGradJob>& entry) {
                                 auto queued = entry.lock();
                                 return !queued || queued->done() || queued == job;
                               }),
                posted_.end());
  posted_.push_back(job);
}

void WeightGradScheduler::run_posted() {
  while (!posted_.empty()) {
    auto job = posted_.front().lock();
    posted_.pop_front();
    if (job) job->run();
  }
}

void WeightGradScheduler::remember_host(const at::Tensor& output) {
  host_ = output.defined() ? output.grad_fn() : nullptr;
}

std::optional<uint64_t> WeightGradScheduler::host() const {
  auto node = host_.lock();
  // A host whose backward has run (a graph the caller keeps alive from an earlier pass) has no
  // window left to offer.
  if (!node || backward_released(*node)) return std::nullopt;
  return node->sequence_nr();
}

}  // namespace hyper_parallel::detail
