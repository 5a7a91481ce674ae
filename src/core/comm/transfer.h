#pragma once
// Internal: one transfer between two ranks, from the moment it is handed to the transport
// (posted, by the calling thread or by the send poster) to its completion.

#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/comm/work.h>

namespace hyper_parallel::comm::detail {

struct Transfer {
  std::mutex mutex;
  std::condition_variable cv;
  c10::intrusive_ptr<c10d::Work> work;  // set once posted
  bool posted = false;
  bool done = false;  // completion observed by a trace waiter (tracing only)
  std::exception_ptr error;
  // How long a wait for this transfer may take: its group's (Group::timeout), handed to the
  // transport's wait, whose own default may differ.
  std::chrono::milliseconds timeout{0};

  explicit Transfer(std::chrono::milliseconds t) : timeout(t) {}
  /// Records the transport's work, or the failure to post it, and wakes whoever waits for it.
  void set_posted(c10::intrusive_ptr<c10d::Work> w, std::exception_ptr e);
  /// The posted work; rethrows a failure to post.
  c10::intrusive_ptr<c10d::Work> wait_posted();
  /// Waits for the transport to complete it, for at most `timeout`; throws on failure or timeout.
  void wait_completed();
};

/// Posts a send or receive of `tensor` with `tag` on `group` and wraps it as a Work whose
/// wait() reports a failure as a c10::Error naming the op, the peer and the chunk. `traceable`
/// transfers get a span in the trace. The one way this library hands bytes to the transport:
/// on `backend` if given (the control channel's connections), else on the group's own.
Work post_transfer(bool is_send, const at::Tensor& tensor, int64_t peer, const Group& group, int tag,
                   bool traceable, c10::intrusive_ptr<c10d::ProcessGroup> backend = {});

/// A transfer of an op's payload (isend, irecv): none for an empty tensor; a send's bytes are
/// counted; traced. On `backend` as post_transfer.
Work post_payload(bool is_send, const at::Tensor& tensor, int64_t peer, const Group& group, int tag,
                  c10::intrusive_ptr<c10d::ProcessGroup> backend = {});

}  // namespace hyper_parallel::comm::detail
