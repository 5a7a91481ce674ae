#include "worker_thread.h"

#include <thread>

#include <hyper_parallel/core/comm/counters.h>

namespace hyper_parallel::comm::detail {

void WorkerThread::submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(std::move(job));
    if (!started_) {
      started_ = true;
      std::thread([this] { run(); }).detach();
    }
  }
  cv_.notify_one();
}

void WorkerThread::run() {
  mark_library_thread();  // its waits are not the training thread's
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return !jobs_.empty(); });
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

}  // namespace hyper_parallel::comm::detail
