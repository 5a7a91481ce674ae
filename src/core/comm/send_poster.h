#pragma once
// Internal: posts large sends from a thread of its own, in order. Gloo writes a send into the
// socket from the thread that posts it, and on a veth link the kernel's TCP work runs there too:
// posted from the calling thread, a 1 MB send held the matmul thread for milliseconds.

#include <memory>

#include "transfer.h"
#include "worker_thread.h"

namespace hyper_parallel::comm::detail {

class SendPoster {
 public:
  /// Sends of at least this size go through the poster.
  static constexpr int64_t kMinBytes = int64_t{64} << 10;

  static SendPoster& get();
  /// Queues the send; `transfer` is marked posted once the transport has it.
  void submit(c10::intrusive_ptr<c10d::ProcessGroup> backend, at::Tensor tensor, int dst, int tag,
              std::shared_ptr<Transfer> transfer);

 private:
  WorkerThread worker_;
};

}  // namespace hyper_parallel::comm::detail
