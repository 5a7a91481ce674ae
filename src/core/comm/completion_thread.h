#pragma once
// Internal: one thread of this library's own that completes asynchronous collectives in the
// order they were started (a PendingAllReduce's second phase: wait for the partials, sum, send
// the result). It posts transfers only for ops the calling thread has started (and reserved
// tags for), so the one-thread-per-group rule for starting ops (op.h) holds. Gloo's send and
// receive works do not report completion until waited for, so polling cannot replace it.

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>

namespace hyper_parallel::comm::detail {

class CompletionThread {
 public:
  static CompletionThread& get();
  /// Runs `job` on the completion thread after the jobs submitted before it. The job must not
  /// throw (it records its own failure).
  void submit(std::function<void()> job);

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool started_ = false;
};

}  // namespace hyper_parallel::comm::detail
