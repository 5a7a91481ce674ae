#include "send_poster.h"

namespace hyper_parallel::comm::detail {

SendPoster& SendPoster::get() {
  static SendPoster* poster = new SendPoster();  // its thread may outlive static destruction
  return *poster;
}

void SendPoster::submit(c10::intrusive_ptr<c10d::ProcessGroup> backend, at::Tensor tensor, int dst, int tag,
                        std::shared_ptr<Transfer> transfer) {
  worker_.submit([backend = std::move(backend), tensor = std::move(tensor), dst, tag,
                  transfer = std::move(transfer)]() mutable {
    c10::intrusive_ptr<c10d::Work> work;
    std::exception_ptr error;
    try {
      std::vector<at::Tensor> tensors{tensor};
      work = backend->send(tensors, dst, tag);
    } catch (...) {
      error = std::current_exception();
    }
    transfer->set_posted(std::move(work), std::move(error));
  });
}

}  // namespace hyper_parallel::comm::detail
