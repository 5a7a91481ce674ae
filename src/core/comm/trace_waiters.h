#pragma once
// Internal, part of the trace: with tracing on, a waiter thread blocks on each transfer, so its
// span ends when the transport completes it (not when the compute thread gets round to waiting);
// the compute thread's wait() then waits for that waiter. The pool grows whenever every waiter
// is busy, so each transfer in flight has its own waiter and lane in the trace.

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>

#include "transfer.h"

namespace hyper_parallel::comm::detail {

class TraceWaiters {
 public:
  static TraceWaiters& get();
  /// Waits for `transfer` on a waiter thread, records its span (from post_us to completion) and
  /// then marks it done.
  void submit(std::shared_ptr<Transfer> transfer, std::string name, int64_t op, int64_t post_us,
              int64_t bytes);

 private:
  struct Job {
    std::shared_ptr<Transfer> transfer;
    std::string name;
    int64_t op = -1, post_us = 0, bytes = 0;
  };
  void run(int64_t lane);

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  size_t threads_ = 0;
  int idle_ = 0;
};

}  // namespace hyper_parallel::comm::detail
