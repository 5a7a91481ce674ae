#include "gather_window.h"

#include <algorithm>
#include <deque>

#include <torch/csrc/autograd/function.h>

#include "attach_backward.h"

namespace hyper_parallel::detail {
namespace {

// Jobs posted on this thread and not yet known to have run.
thread_local std::deque<std::weak_ptr<WindowJob>> posted;
thread_local std::weak_ptr<torch::autograd::Node> host_node;

}  // namespace

void post_window_job(const std::shared_ptr<WindowJob>& job) {
  // Entries already run or freed are dropped first, so a thread no window drains keeps none, and
  // so is this job's own entry from a pass that left it unrun: one entry per job.
  posted.erase(std::remove_if(posted.begin(), posted.end(),
                              [&](const std::weak_ptr<WindowJob>& entry) {
                                auto queued = entry.lock();
                                return !queued || queued->done() || queued == job;
                              }),
               posted.end());
  posted.push_back(job);
}

void run_window_jobs() {
  while (!posted.empty()) {
    auto job = posted.front().lock();
    posted.pop_front();
    if (job) job->run();
  }
}

void remember_gather_host(const at::Tensor& output) {
  host_node = output.defined() ? output.grad_fn() : nullptr;
}

std::optional<uint64_t> gather_host() {
  auto node = host_node.lock();
  // A host whose backward has run (a graph the caller keeps alive from an earlier pass) has no
  // window left to offer.
  if (!node || backward_released(*node)) return std::nullopt;
  return node->sequence_nr();
}

}  // namespace hyper_parallel::detail
