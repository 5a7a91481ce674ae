#pragma once
// Internal: the weight-gradient scheduler, work a later backward gather's transfers can hide
// (Megatron's WeightGradStore, driven by the gathers themselves).
//
// Some backward work has no collective of its own to hide behind (a row Linear's dW needs its
// whole gather; a layer sharing another's gather has none), so its node posts it as a job
// instead of running it. The next backward node that gathers over the link (an MC2 row
// Linear's gather of dY, or the all_gather under a Partial -> Shard redistribute's backward:
// a row-parallel output, the embedding's) runs the posted jobs while its last chunks travel,
// once this rank has forwarded everything it forwards. Such a node is a "gather host": a
// forward op whose backward gathers is remembered as the host, and a poster recorded after it
// in forward defers to it (for Llama's MC2 layers: w2's and w3's dW into wo's gather, wo's,
// wk's and wv's into the previous layer's w2, layer 0's into the embedding's gather). Whoever
// posts also keeps a way to run the job when no window does.
//
// One scheduler per thread (of_this_thread): the CPU engine runs a backward's nodes on the
// thread that called it, so posters and hosts of one backward meet in one scheduler, and
// nothing here needs a lock. MC2's layers (tensor_parallel/mc2) and DTensor's redistribute
// take the calling thread's at the point of use.

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>

#include <ATen/core/Tensor.h>

namespace torch::autograd {
struct Node;
}

namespace hyper_parallel::detail {

/// A job posted for the next gather window.
class WeightGradJob {
 public:
  virtual ~WeightGradJob() = default;
  /// Runs the job unless it has run; must not throw (a failure is kept for its owner).
  virtual void run() = 0;
  virtual bool done() const = 0;
};

class WeightGradScheduler {
 public:
  /// The calling thread's scheduler.
  static WeightGradScheduler& of_this_thread();

  /// Queues `job` (weakly: a pass freed with the job unrun drops it) for the next window. A job
  /// already queued is queued once.
  void post(const std::shared_ptr<WeightGradJob>& job);

  /// Runs every posted job that has not run: a backward gather calls it while its last chunks
  /// travel.
  void run_posted();

  /// Remembers the node of `output` (a forward op's result whose backward gathers) as the host
  /// of the jobs of the ops recorded next. An output without a node (recorded under no-grad)
  /// leaves them no host: an older graph's host would deliver them late.
  void remember_host(const at::Tensor& output);

  /// That host's sequence number while its node is alive and its backward has not run; none
  /// otherwise.
  std::optional<uint64_t> host() const;

 private:
  WeightGradScheduler() = default;

  std::deque<std::weak_ptr<WeightGradJob>> posted_;  // not yet known to have run
  std::weak_ptr<torch::autograd::Node> host_;
};

}  // namespace hyper_parallel::detail
