#include <hyper_parallel/core/comm/p2p.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/counters.h>
#include <hyper_parallel/core/comm/trace.h>

#include "flight_recorder.h"
#include "group_impl.h"

namespace hyper_parallel::comm {
namespace {

// Internal tags live above the user range: base | op block | step.
constexpr int64_t kInternalTagBase = int64_t{1} << 30;
constexpr int64_t kOpBlocks = int64_t{1} << 19;  // blocks wrap; 2^19 ops apart never overlap

// One transfer: posted to the transport (by the calling thread, or by the poster thread for
// large sends), then completed.
struct Transfer {
  std::mutex mutex;
  std::condition_variable cv;
  c10::intrusive_ptr<c10d::Work> work;  // set once posted
  bool posted = false;
  bool done = false;  // completion observed by a waiter thread (tracing only)
  std::exception_ptr error;

  void set_posted(c10::intrusive_ptr<c10d::Work> w, std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      work = std::move(w);
      error = std::move(e);
      posted = true;
    }
    cv.notify_all();
  }
  // The posted work; rethrows a failure to post.
  c10::intrusive_ptr<c10d::Work> wait_posted() {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return posted; });
    if (error) std::rethrow_exception(error);
    return work;
  }
};

// Posts large sends from its own thread, in order. Gloo writes a send into the socket from the
// thread that posts it, and on a veth link the kernel's TCP work runs there too: posted from the
// calling thread, a 1 MB send held the matmul thread for milliseconds.
class SendPoster {
 public:
  static SendPoster& get() {
    static SendPoster* poster = new SendPoster();  // its thread may outlive static destruction
    return *poster;
  }
  void submit(c10::intrusive_ptr<c10d::ProcessGroup> backend, at::Tensor tensor, int dst, int tag,
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

 private:
  struct Job {
    c10::intrusive_ptr<c10d::ProcessGroup> backend;
    at::Tensor tensor;
    int dst, tag;
    std::shared_ptr<Transfer> transfer;
  };
  void run() {
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
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool started_ = false;
};

// With tracing on, a waiter thread blocks on each transfer, so the span ends when the transport
// completes it; the compute thread's wait() then waits for that waiter. The pool grows whenever
// every waiter is busy, so each transfer in flight has its own waiter and lane in the trace.
class WaiterPool {
 public:
  static WaiterPool& get() {
    static WaiterPool* pool = new WaiterPool();  // its threads may outlive static destruction
    return *pool;
  }
  void submit(std::shared_ptr<Transfer> transfer, std::string name, int64_t op, int64_t post_us,
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

 private:
  struct Job {
    std::shared_ptr<Transfer> transfer;
    std::string name;
    int64_t op, post_us, bytes;
  };
  void run(int64_t lane) {
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
        job.transfer->wait_posted()->wait();
      } catch (...) {
        error = std::current_exception();
      }
      trace::detail::record_transfer(job.name, job.op, job.post_us, trace::detail::now_us(),
                                     job.bytes, lane);
      {
        std::lock_guard<std::mutex> lock(job.transfer->mutex);
        job.transfer->done = true;
        if (!job.transfer->error) job.transfer->error = error;
      }
      job.transfer->cv.notify_all();
    }
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  size_t threads_ = 0;
  int idle_ = 0;
};

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
    try {
      if (traced_) {
        std::unique_lock<std::mutex> lock(transfer_->mutex);
        transfer_->cv.wait(lock, [&] { return transfer_->done; });
        if (transfer_->error) std::rethrow_exception(transfer_->error);
      } else {
        transfer_->wait_posted()->wait();
      }
    } catch (const std::exception& e) {
      const auto op = detail::FlightRecorder::current();
      const std::string context =
          op ? op->kind + " (call " + std::to_string(op->seq) + " on " + op->group + ", " + op->shape + ")"
             : std::string("a transfer");
      recorder.report(global_rank(), "a transfer failed");
      TORCH_CHECK(false, "hyper_parallel::comm: ", context, ": ", what_,
                  chunk.empty() ? "" : ", " + chunk, " failed: ", e.what());
    }
    recorder.clear_waiting();
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

// Sends of at least this size are posted by the poster thread.
constexpr int64_t kPostedSendBytes = int64_t{64} << 10;

// Gloo 1.13 rejects bf16 in some paths; transfers only move bytes, so send 2-byte floats as int16.
at::Tensor as_wire_tensor(const at::Tensor& t) {
  if (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf) return t.view(at::kShort);
  return t;
}

void check_transfer(const char* fn, const at::Tensor& t, int64_t peer, const Group& group) {
  TORCH_CHECK(t.defined(), "hyper_parallel::comm::", fn, ": expected a defined tensor, got undefined");
  TORCH_CHECK(t.is_contiguous(), "hyper_parallel::comm::", fn,
              ": expected a contiguous tensor, got strides ", t.strides());
  TORCH_CHECK(peer >= 0 && peer < group.size(), "hyper_parallel::comm::", fn,
              ": expected peer rank in [0, ", group.size(), ") of ", group.name(), ", got ", peer);
  TORCH_CHECK(peer != group.rank(), "hyper_parallel::comm::", fn,
              ": expected a peer other than this rank (", peer, ")");
}

}  // namespace

int OpTags::step(int64_t step) const {
  TORCH_INTERNAL_ASSERT(step >= 0 && step < kMaxSteps, "OpTags::step: step ", step,
                        " out of range");
  return static_cast<int>(base_ + step);
}

OpTags reserve_tags(const Group& group) {
  int64_t op = group.impl().next_op.fetch_add(1) % kOpBlocks;
  static_assert(kInternalTagBase + kOpBlocks * OpTags::kMaxSteps < (int64_t{1} << 31));
  return OpTags(kInternalTagBase + op * OpTags::kMaxSteps);
}

namespace {

thread_local bool t_skip_transfers = false;

// Posts one transfer (a send from the poster thread when large) and wraps it as a Work.
Work post(bool is_send, const at::Tensor& tensor, int64_t peer, const Group& group, int tag,
          bool traceable) {
  if (t_skip_transfers) {
    if (!is_send) tensor.zero_();
    return Work();
  }
  const int64_t bytes = static_cast<int64_t>(tensor.nbytes());
  const int64_t post_us = traceable && trace::enabled() ? trace::detail::now_us() : -1;
  auto transfer = std::make_shared<Transfer>();
  auto wire = as_wire_tensor(tensor);
  const auto& backend = group.impl().backend;
  if (is_send && bytes >= kPostedSendBytes) {
    SendPoster::get().submit(backend, wire, static_cast<int>(peer), tag, transfer);
  } else {
    std::vector<at::Tensor> tensors{wire};
    transfer->set_posted(is_send ? backend->send(tensors, static_cast<int>(peer), tag)
                                 : backend->recv(tensors, static_cast<int>(peer), tag),
                         nullptr);
  }
  const int64_t peer_global = group.global_ranks()[peer];
  const auto what = (is_send ? "send to rank " : "receive from rank ") + std::to_string(peer) +
                    " of " + group.name() + " (global rank " + std::to_string(peer_global) + ")";
  if (post_us >= 0) {
    WaiterPool::get().submit(transfer, (is_send ? "send to " : "recv from ") + std::to_string(peer),
                             trace::detail::current_op(), post_us, bytes);
  }
  return Work(std::make_shared<TransferWork>(std::move(transfer), post_us >= 0, what, peer_global));
}

// Control messages (op signatures) share one tag per group, below the operations' tag blocks.
constexpr int kControlTag = static_cast<int>(kInternalTagBase - 1);

}  // namespace

Work isend(const at::Tensor& tensor, int64_t dst, const Group& group, int tag) {
  check_transfer("isend", tensor, dst, group);
  if (tensor.numel() == 0) return Work();
  if (!t_skip_transfers) detail::record_payload_bytes(static_cast<int64_t>(tensor.nbytes()));
  return post(/*is_send=*/true, tensor, dst, group, tag, /*traceable=*/true);
}

Work irecv(const at::Tensor& tensor, int64_t src, const Group& group, int tag) {
  check_transfer("irecv", tensor, src, group);
  if (tensor.numel() == 0) return Work();
  return post(/*is_send=*/false, tensor, src, group, tag, /*traceable=*/true);
}

namespace detail {

SkipTransfers::SkipTransfers() : previous_(t_skip_transfers) { t_skip_transfers = true; }
SkipTransfers::~SkipTransfers() { t_skip_transfers = previous_; }
bool transfers_skipped() { return t_skip_transfers; }

Work post_control(bool is_send, const at::Tensor& tensor, int64_t peer, const Group& group) {
  return post(is_send, tensor, peer, group, kControlTag, /*traceable=*/false);
}

}  // namespace detail

}  // namespace hyper_parallel::comm
