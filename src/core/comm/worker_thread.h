#pragma once
// Internal: a thread of this library's own that runs jobs one at a time, in the order they were
// submitted, started by the first job. The send poster and the completion thread are two of
// them (two, not one: a completion job waits for sends the poster has yet to post).

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>

namespace hyper_parallel::comm::detail {

class WorkerThread {
 public:
  /// Runs `job` on this worker after the jobs submitted before it. The job must not throw (it
  /// records its own failure).
  void submit(std::function<void()> job);

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool started_ = false;
};

}  // namespace hyper_parallel::comm::detail
