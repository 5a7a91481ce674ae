#pragma once
// Internal: a thread of this library's own that runs jobs one at a time, in the order they were
// submitted, started by the first job. The send poster and each group's completion thread are
// such workers (two, not one: a completion job waits for sends the poster has yet to post).

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>

namespace hyper_parallel::comm::detail {

class WorkerThread {
 public:
  WorkerThread();
  /// Does not wait: the thread runs the jobs already submitted, then ends. So a worker may be
  /// destroyed from one of its own jobs (a job that drops the last handle of the worker's owner).
  ~WorkerThread();
  WorkerThread(const WorkerThread&) = delete;
  WorkerThread& operator=(const WorkerThread&) = delete;

  /// Runs `job` on this worker after the jobs submitted before it. The job must not throw (it
  /// records its own failure).
  void submit(std::function<void()> job);

 private:
  struct Queue {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<std::function<void()>> jobs;
    bool started = false;
    bool closed = false;  // the worker was destroyed: end once `jobs` is empty
  };
  static void run(const std::shared_ptr<Queue>& queue);

  std::shared_ptr<Queue> queue_;  // shared with the thread, which may outlive this object
};

}  // namespace hyper_parallel::comm::detail
