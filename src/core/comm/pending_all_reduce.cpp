#include <hyper_parallel/core/comm/pending_all_reduce.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <sstream>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/chunks.h>
#include <hyper_parallel/core/comm/counters.h>
#include <hyper_parallel/core/comm/p2p.h>
#include <hyper_parallel/core/comm/schedule.h>
#include <hyper_parallel/core/comm/skip_transfers.h>
#include <hyper_parallel/core/comm/work.h>

#include "completion_thread.h"
#include "flight_recorder.h"

namespace hyper_parallel::comm {

namespace detail {

struct PendingAllReduceState {
  PendingAllReduceState(at::Tensor b, ReduceOp o, Group g)
      : buffer(std::move(b)), op(o), group(std::move(g)), tags(reserve_tags(group)) {}

  at::Tensor block(int64_t b) const {
    const int64_t n = buffer.numel(), p = group.size();
    return buffer.narrow(0, chunk_offset(n, p, b), chunk_size(n, p, b));
  }

  // Phase 1, on the calling thread: block b to its owner b; the other ranks' partials of this
  // rank's block arrive.
  void post_reduce() {
    const int64_t p = group.size(), r = group.rank();
    partials.resize(p);
    partials[r] = block(r);
    for (int64_t q = 0; q < p; ++q) {
      if (q == r) continue;
      partials[q] = at::empty_like(partials[r]);
      receives.push_back(irecv(partials[q], q, group, tags.step(0)));
    }
    for (int64_t s = 1; s < p; ++s) {
      const int64_t owner = (r + s) % p;  // each rank starts with a different peer
      sends.push_back(isend(block(owner), owner, group, tags.step(0)));
    }
  }

  // Phase 2, on the completion thread: this rank's block, summed in rank order, to every other
  // rank; theirs into place. Their memory was sent from in phase 1, so its sends are waited first.
  void gather() {
    const int64_t p = group.size(), r = group.rank();
    wait_all();
    sum_partials_into(partials[r]);
    partials.clear();
    for (int64_t q = 0; q < p; ++q) {
      if (q != r) receives.push_back(irecv(block(q), q, group, tags.step(1)));
    }
    for (int64_t s = 1; s < p; ++s) sends.push_back(isend(block(r), (r + s) % p, group, tags.step(1)));
    wait_all();
  }

  // The partials summed in rank order in the accumulate dtype, divided for an average, rounded
  // once into `out`; a slice at a time through a scratch of one slice, so that no temporary the
  // size of the block is allocated (and page-faulted) per bucket and each slice's passes stay in
  // cache. The same operations per element as one whole-block sum: the same bits.
  void sum_partials_into(const at::Tensor& out) const {
    constexpr int64_t kSliceElements = int64_t{1} << 17;
    const int64_t n = out.numel(), p = group.size();
    auto scratch =
        at::empty({std::min(n, kSliceElements)}, out.options().dtype(accumulate_type(out.scalar_type())));
    for (int64_t offset = 0; offset < n; offset += kSliceElements) {
      const int64_t len = std::min(kSliceElements, n - offset);
      auto sum = scratch.narrow(0, 0, len);
      sum.copy_(partials[0].narrow(0, offset, len));
      for (int64_t q = 1; q < p; ++q) sum.add_(partials[q].narrow(0, offset, len));
      if (op == ReduceOp::kAvg) sum.div_(p);
      out.narrow(0, offset, len).copy_(sum);
    }
  }

  void wait_all() {
    for (auto& w : receives) w.wait();
    for (auto& w : sends) w.wait();
    receives.clear();
    sends.clear();
  }

  void complete(std::exception_ptr failure) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      error = std::move(failure);
      done = true;
    }
    cv.notify_all();
  }

  at::Tensor buffer;
  ReduceOp op;
  Group group;
  OpTags tags;
  std::vector<at::Tensor> partials;
  std::vector<Work> receives, sends;
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
};

}  // namespace detail

PendingAllReduce::PendingAllReduce(std::shared_ptr<detail::PendingAllReduceState> state)
    : state_(std::move(state)) {}

bool PendingAllReduce::is_completed() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done;
}

void PendingAllReduce::wait() {
  if (!state_) return;
  auto state = std::move(state_);
  const auto start = std::chrono::steady_clock::now();
  {
    std::unique_lock<std::mutex> lock(state->mutex);
    state->cv.wait(lock, [&] { return state->done; });
  }
  detail::record_exposed_wait(
      "pending all_reduce", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  if (state->error) std::rethrow_exception(state->error);
}

PendingAllReduce start_all_reduce(const at::Tensor& buffer, ReduceOp op, const Group& group,
                                  Agreement agreement) {
  TORCH_CHECK_TYPE(buffer.defined() && at::isFloatingType(buffer.scalar_type()),
                   "hyper_parallel::comm::start_all_reduce: expected a floating-point tensor, got ",
                   buffer.defined() ? c10::toString(buffer.scalar_type()) : "an undefined tensor");
  TORCH_CHECK_VALUE(buffer.is_contiguous(),
                    "hyper_parallel::comm::start_all_reduce: expected a contiguous buffer, got ", "strides ",
                    buffer.strides());
  TORCH_CHECK_VALUE(group.size() <= OpTags::kMaxSteps,
                    "hyper_parallel::comm::start_all_reduce: expected a group of at most ", OpTags::kMaxSteps,
                    " ranks, got ", group.size());
  std::ostringstream what;
  what << buffer.scalar_type() << buffer.sizes() << " on " << group.name() << " (started)";
  OpScope scope(group,
                {CollectiveKind::kAllReduce,
                 buffer.scalar_type(),
                 {buffer.numel(), static_cast<int64_t>(op == ReduceOp::kAvg)},
                 {"numel", "avg"}},
                what.str(), /*counted=*/true, agreement);
  // Detached: the in-place sums on the completion thread never touch autograd's metadata.
  auto state = std::make_shared<detail::PendingAllReduceState>(buffer.detach().view({-1}), op, group);
  if (group.size() == 1) {
    state->done = true;  // the sum and the average of one rank's tensor: itself
    return PendingAllReduce(std::move(state));
  }
  state->post_reduce();
  // Thread-local settings, carried to the completion thread: skipped transfers (benchmarks'
  // compute-only twins), the counters' region, and the op's flight-recorder record, which stays
  // open until phase 2 ends (a hang or a failure there names this op and the peer).
  const bool skipped = detail::transfers_skipped();
  detail::completion_thread(group.impl())
      .submit([state, skipped, region = detail::current_region(), record = scope.keep_record_open()] {
        std::exception_ptr failure;
        detail::FlightRecorder::set_current(record);
        try {
          CommRegion counted_in(region);
          at::NoGradGuard no_grad;
          std::optional<detail::SkipTransfers> skip;
          if (skipped) skip.emplace();
          state->gather();
        } catch (...) {
          failure = std::current_exception();
        }
        if (record) detail::FlightRecorder::get().end(record, failure == nullptr);
        detail::FlightRecorder::set_current(nullptr);
        state->complete(std::move(failure));
      });
  return PendingAllReduce(std::move(state));
}

}  // namespace hyper_parallel::comm
