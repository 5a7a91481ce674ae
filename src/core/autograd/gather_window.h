#pragma once
// Internal: work a later backward gather's transfers can hide.
//
// Some backward work has no collective of its own to hide behind (a row Linear's dW needs its
// whole gather; a layer sharing another's gather has none), so its node posts it as a job
// instead of running it. The next backward node that gathers over the link (an MC2 row
// Linear's gather of dY, or the all_gather under a Partial -> Shard redistribute's backward:
// a row-parallel output, the embedding's) runs the jobs posted on its thread while its last
// chunks travel, once this rank has forwarded everything it forwards. Such a node is a "gather
// host": a forward op whose backward gathers remembers its output's node, and a poster recorded
// after it in forward defers to it (for Llama's MC2 layers: w2's and w3's dW into wo's gather,
// wo's, wk's and wv's into the previous layer's w2, layer 0's into the embedding's gather).
// Whoever posts also keeps a way to run the job when no window does. Everything here is per
// thread: the CPU engine runs a backward's nodes on the thread that called it.

#include <cstdint>
#include <memory>
#include <optional>

#include <ATen/core/Tensor.h>

namespace hyper_parallel::detail {

/// A job posted for the next gather window.
class WindowJob {
 public:
  virtual ~WindowJob() = default;
  /// Runs the job unless it has run; must not throw (a failure is kept for its owner).
  virtual void run() = 0;
  virtual bool done() const = 0;
};

/// Queues `job` (weakly: a pass freed with the job unrun drops it) on this thread for the next
/// window. A job already queued is queued once.
void post_window_job(const std::shared_ptr<WindowJob>& job);

/// Runs every job posted on this thread that has not run: a backward gather calls it while its
/// last chunks travel.
void run_window_jobs();

/// Remembers the node of `output` (a forward op's result whose backward gathers) as the host of
/// the jobs of the ops recorded next on this thread. An output without a node (recorded under
/// no-grad) leaves them no host: an older graph's host would deliver them late.
void remember_gather_host(const at::Tensor& output);

/// That host's sequence number while its node is alive and its backward has not run; none
/// otherwise.
std::optional<uint64_t> gather_host();

}  // namespace hyper_parallel::detail
