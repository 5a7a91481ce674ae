#include "trace_waiters.h"

#include <thread>

#include <hyper_parallel/core/comm/trace.h>

namespace hyper_parallel::comm::detail {

TraceWaiters& TraceWaiters::get() {
  static TraceWaiters* pool = new TraceWaiters();  // its threads may outlive static destruction
  return *pool;
}

void TraceWaiters::submit(std::shared_ptr<Transfer> transfer, std::string name, int64_t op, int64_t post_us,
                          int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  jobs_.push_back({std::move(transfer), std::move(name), op, post_us, bytes});
  if (idle_ == 0) {
    const int64_t lane = static_cast<int64_t>(threads_++);
    std::thread([this, lane] { run(lane); }).detach();
  } else {
    cv_.notify_one();
  }
}

void TraceWaiters::run(int64_t lane) {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ++idle_;
      cv_.wait(lock, [&] { return !jobs_.empty(); });
      --idle_;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    std::exception_ptr error;
    try {
      job.transfer->wait_completed();
    } catch (...) {
      error = std::current_exception();
    }
    trace::detail::record_transfer(job.name, job.op, job.post_us, trace::detail::now_us(), job.bytes, lane);
    {
      std::lock_guard<std::mutex> lock(job.transfer->mutex);
      job.transfer->done = true;
      if (!job.transfer->error) job.transfer->error = error;
    }
    job.transfer->cv.notify_all();
  }
}

}  // namespace hyper_parallel::comm::detail
