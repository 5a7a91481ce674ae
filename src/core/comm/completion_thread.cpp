#include "completion_thread.h"

#include <thread>

namespace hyper_parallel::comm::detail {

CompletionThread& CompletionThread::get() {
  static CompletionThread* thread = new CompletionThread();  // may outlive static destruction
  return *thread;
}

void CompletionThread::submit(std::function<void()> job) {
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

void CompletionThread::run() {
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
