// Posting a transfer: tags, the checks on a send or receive, and the Work that waits for it.
#include <hyper_parallel/core/comm/p2p.h>

#include <chrono>

#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/counters.h>
#include <hyper_parallel/core/comm/trace.h>

#include "flight_recorder.h"
#include "group_impl.h"
#include "send_poster.h"
#include "tags.h"
#include "trace_waiters.h"
#include "transfer.h"
#include "test_hooks.h"

namespace hyper_parallel::comm {

namespace detail {

void Transfer::set_posted(c10::intrusive_ptr<c10d::Work> w, std::exception_ptr e) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    work = std::move(w);
    error = std::move(e);
    posted = true;
  }
  cv.notify_all();
}

c10::intrusive_ptr<c10d::Work> Transfer::wait_posted() {
  std::unique_lock<std::mutex> lock(mutex);
  TORCH_CHECK(cv.wait_for(lock, timeout, [&] { return posted; }),
              "expected the transport to accept it within the group's timeout of ", timeout.count(),
              " ms, got no answer");
  if (error) std::rethrow_exception(error);
  return work;
}

void Transfer::wait_completed() {
  // Gloo's wait with a timeout throws "Timed out waiting ... ms" and fails the other pending
  // transfers on the same connections (the group's own, or its control channel's:
  // control_channel.h), so none completes later into a freed buffer.
  wait_posted()->wait(timeout);
}

}  // namespace detail

namespace {

using detail::Transfer;

// The Work of one transfer. Its wait() tells the flight recorder whom this rank waits for, and
// turns a transport failure (peer gone, timeout) into a c10::Error that names the op, its group,
// its shapes, the peer and the chunk, after the rank has printed its recent ops.
class TransferWork final : public detail::WorkImpl {
 public:
  TransferWork(std::shared_ptr<Transfer> transfer, bool traced, std::string what, int64_t peer_global)
      : transfer_(std::move(transfer)), traced_(traced), what_(std::move(what)), peer_(peer_global) {}
  void wait() override {
    auto& recorder = detail::FlightRecorder::get();
    const auto chunk = detail::FlightRecorder::chunk_label();
    recorder.set_waiting(peer_, chunk.empty() ? what_ : what_ + ", " + chunk);
    const auto start = std::chrono::steady_clock::now();
    try {
      if (traced_) {
        std::unique_lock<std::mutex> lock(transfer_->mutex);
        transfer_->cv.wait(lock, [&] { return transfer_->done; });
        if (transfer_->error) std::rethrow_exception(transfer_->error);
      } else {
        transfer_->wait_completed();
      }
    } catch (const std::exception& e) {
      const auto op = detail::FlightRecorder::current();
      const std::string context =
          op ? op->kind + " (call " + std::to_string(op->seq) + " on " + op->group + ", " + op->shape + ")"
             : std::string("a transfer");
      recorder.report(global_rank(), "a transfer failed");
      TORCH_CHECK(false, "hyper_parallel::comm: ", context, ": ", what_, chunk.empty() ? "" : ", " + chunk,
                  " failed: ", e.what());
    }
    recorder.clear_waiting();
    const auto op = detail::FlightRecorder::current();
    detail::record_exposed_wait(
        op ? std::string_view(op->kind) : std::string_view(),
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(transfer_->mutex);
    return traced_ ? transfer_->done : (transfer_->posted && transfer_->work->isCompleted());
  }

 private:
  std::shared_ptr<Transfer> transfer_;
  bool traced_;
  std::string what_;
  int64_t peer_;
};

// Gloo 1.13 rejects bf16 and bool in some paths; transfers only move bytes, so send 2-byte floats as
// int16 and bool as uint8.
at::Tensor as_wire_tensor(const at::Tensor& t) {
  if (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf) return t.view(at::kShort);
  if (t.scalar_type() == at::kBool) return t.view(at::kByte);
  return t;
}

void check_transfer(const char* fn, const at::Tensor& t, int64_t peer, const Group& group) {
  TORCH_CHECK(t.defined(), "hyper_parallel::comm::", fn, ": expected a defined tensor, got undefined");
  TORCH_CHECK(t.is_contiguous(), "hyper_parallel::comm::", fn, ": expected a contiguous tensor, got strides ",
              t.strides());
  TORCH_CHECK(peer >= 0 && peer < group.size(), "hyper_parallel::comm::", fn, ": expected peer rank in [0, ",
              group.size(), ") of ", group.name(), ", got ", peer);
  TORCH_CHECK(peer != group.rank(), "hyper_parallel::comm::", fn, ": expected a peer other than this rank (",
              peer, ")");
}

}  // namespace

int OpTags::step(int64_t step) const {
  TORCH_INTERNAL_ASSERT(step >= 0 && step < kMaxSteps, "OpTags::step: step ", step, " out of range");
  return static_cast<int>(base_ + step);
}

OpTags reserve_tags(const Group& group) {
  const int64_t block = group.impl().next_op.fetch_add(1) % detail::kOpBlocks;
  return OpTags(detail::kInternalTagBase + block * OpTags::kMaxSteps);
}

namespace detail {

Work post_transfer(bool is_send, const at::Tensor& tensor, int64_t peer, const Group& group, int tag,
                   bool traceable, c10::intrusive_ptr<c10d::ProcessGroup> backend) {
  if (test_hooks::transfers_skipped()) {
    if (!is_send) tensor.zero_();
    return Work();
  }
  const int64_t bytes = static_cast<int64_t>(tensor.nbytes());
  const int64_t post_us = traceable && trace::enabled() ? trace::detail::now_us() : -1;
  TORCH_INTERNAL_ASSERT(group.timeout().count() > 0, "post_transfer: group ", group.name(),
                        " has no timeout");
  auto transfer = std::make_shared<Transfer>(group.timeout());
  auto wire = as_wire_tensor(tensor);
  if (!backend) backend = group.impl().backend;
  if (is_send && bytes >= SendPoster::kMinBytes) {
    SendPoster::get().submit(backend, wire, static_cast<int>(peer), tag, transfer);
  } else {
    std::vector<at::Tensor> tensors{wire};
    transfer->set_posted(is_send ? backend->send(tensors, static_cast<int>(peer), tag)
                                 : backend->recv(tensors, static_cast<int>(peer), tag),
                         nullptr);
  }
  const int64_t peer_global = group.global_ranks()[peer];
  const auto what = (is_send ? "send to rank " : "receive from rank ") + std::to_string(peer) + " of " +
                    group.name() + " (global rank " + std::to_string(peer_global) + ")";
  if (post_us >= 0) {
    TraceWaiters::get().submit(transfer, (is_send ? "send to " : "recv from ") + std::to_string(peer),
                               trace::detail::current_op(), post_us, bytes);
  }
  return Work(std::make_shared<TransferWork>(std::move(transfer), post_us >= 0, what, peer_global));
}

Work post_payload(bool is_send, const at::Tensor& tensor, int64_t peer, const Group& group, int tag,
                  c10::intrusive_ptr<c10d::ProcessGroup> backend) {
  if (tensor.numel() == 0) return Work();
  if (is_send && !test_hooks::transfers_skipped())
    record_payload_bytes(static_cast<int64_t>(tensor.nbytes()));
  return post_transfer(is_send, tensor, peer, group, tag, /*traceable=*/true, std::move(backend));
}

}  // namespace detail

Work isend(const at::Tensor& tensor, int64_t dst, const Group& group, int tag) {
  check_transfer("isend", tensor, dst, group);
  return detail::post_payload(/*is_send=*/true, tensor, dst, group, tag);
}

Work irecv(const at::Tensor& tensor, int64_t src, const Group& group, int tag) {
  check_transfer("irecv", tensor, src, group);
  return detail::post_payload(/*is_send=*/false, tensor, src, group, tag);
}

}  // namespace hyper_parallel::comm
