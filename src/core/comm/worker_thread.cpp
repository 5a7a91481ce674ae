#include "worker_thread.h"

#include <thread>

#include <hyper_parallel/core/comm/counters.h>

namespace hyper_parallel::comm::detail {

WorkerThread::WorkerThread() : queue_(std::make_shared<Queue>()) {}

WorkerThread::~WorkerThread() {
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    queue_->closed = true;
  }
  queue_->cv.notify_one();
}

void WorkerThread::submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    queue_->jobs.push_back(std::move(job));
    if (!queue_->started) {
      queue_->started = true;
      std::thread([queue = queue_] { run(queue); }).detach();
    }
  }
  queue_->cv.notify_one();
}

void WorkerThread::run(const std::shared_ptr<Queue>& queue) {
  mark_library_thread();  // its waits are not the training thread's
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(queue->mutex);
      queue->cv.wait(lock, [&] { return !queue->jobs.empty() || queue->closed; });
      if (queue->jobs.empty()) return;  // closed, and nothing left to run
      job = std::move(queue->jobs.front());
      queue->jobs.pop_front();
    }
    job();  // may destroy this worker's owner, and with it the WorkerThread: `queue` stays
  }
}

}  // namespace hyper_parallel::comm::detail
