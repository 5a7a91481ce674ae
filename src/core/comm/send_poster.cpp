#include "send_poster.h"

#include <thread>

namespace hyper_parallel::comm::detail {

SendPoster& SendPoster::get() {
  static SendPoster* poster = new SendPoster();  // its thread may outlive static destruction
  return *poster;
}

void SendPoster::submit(c10::intrusive_ptr<c10d::ProcessGroup> backend, at::Tensor tensor, int dst, int tag,
                        std::shared_ptr<Transfer> transfer) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back({std::move(backend), std::move(tensor), dst, tag, std::move(transfer)});
    if (!started_) {
      started_ = true;
      std::thread([this] { run(); }).detach();
    }
  }
  cv_.notify_one();
}

void SendPoster::run() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return !jobs_.empty(); });
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    c10::intrusive_ptr<c10d::Work> work;
    std::exception_ptr error;
    try {
      std::vector<at::Tensor> tensors{job.tensor};
      work = job.backend->send(tensors, job.dst, job.tag);
    } catch (...) {
      error = std::current_exception();
    }
    job.transfer->set_posted(std::move(work), std::move(error));
  }
}

}  // namespace hyper_parallel::comm::detail
