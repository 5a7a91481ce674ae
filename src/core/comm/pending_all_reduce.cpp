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
#include <hyper_parallel/core/comm/trace.h>
#include <hyper_parallel/core/comm/work.h>

#include "flight_recorder.h"
#include "group_impl.h"
#include "pending_all_reduce_state.h"
#include "test_hooks.h"

namespace hyper_parallel::comm {

namespace detail {

at::Tensor PendingAllReduceState::block(int64_t b) const {
  const int64_t n = buffer.numel(), p = group.size();
  return buffer.narrow(0, chunk_offset(n, p, b), chunk_size(n, p, b));
}

void PendingAllReduceState::post_reduce(int64_t step) {
  const int64_t p = group.size(), r = group.rank();
  partials.resize(p);
  partials[r] = block(r);
  for (int64_t q = 0; q < p; ++q) {
    if (q == r) continue;
    partials[q] = at::empty_like(partials[r]);
    receives.push_back(irecv(partials[q], q, group, tags.step(step)));
  }
  for (int64_t s = 1; s < p; ++s) {
    const int64_t owner = (r + s) % p;  // each rank starts with a different peer
    sends.push_back(isend(block(owner), owner, group, tags.step(step)));
  }
}

// Phase 1's sends read the blocks phase 2 overwrites, so they are waited first.
void PendingAllReduceState::gather(int64_t step) {
  const int64_t p = group.size(), r = group.rank();
  wait_all();
  sum_in_rank_order(partials, partials[r], op);
  partials.clear();
  for (int64_t q = 0; q < p; ++q) {
    if (q != r) receives.push_back(irecv(block(q), q, group, tags.step(step)));
  }
  for (int64_t s = 1; s < p; ++s) sends.push_back(isend(block(r), (r + s) % p, group, tags.step(step)));
  wait_all();
}

void PendingAllReduceState::wait_all() {
  for (auto& w : receives) w.wait();
  for (auto& w : sends) w.wait();
  receives.clear();
  sends.clear();
}

void PendingAllReduceState::complete(std::exception_ptr failure) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    error = std::move(failure);
    done = true;
  }
  cv.notify_all();
}

// A slice at a time through a scratch of one slice, so that no temporary the size of the block
// is allocated (and page-faulted) per bucket and each slice's passes stay in cache.
void sum_in_rank_order(const std::vector<at::Tensor>& partials, const at::Tensor& out, ReduceOp op) {
  constexpr int64_t kSliceElements = int64_t{1} << 17;
  const int64_t n = out.numel(), p = static_cast<int64_t>(partials.size());
  auto scratch =
      at::empty({std::min(n, kSliceElements)}, out.options().dtype(accumulate_type(out.scalar_type())));
  for (int64_t offset = 0; offset < n; offset += kSliceElements) {
    const int64_t len = std::min(kSliceElements, n - offset);
    auto sum = scratch.narrow(0, 0, len);
    sum.copy_(partials[0].reshape({-1}).narrow(0, offset, len));
    for (int64_t q = 1; q < p; ++q) sum.add_(partials[q].reshape({-1}).narrow(0, offset, len));
    if (op == ReduceOp::kAvg) sum.div_(p);
    out.view({-1}).narrow(0, offset, len).copy_(sum);
  }
}

void complete_on_completion_thread(const std::shared_ptr<PendingAllReduceState>& state, OpScope& scope,
                                   std::function<void(PendingAllReduceState&)> work) {
  // Thread-local settings, carried to the completion thread: skipped transfers (benchmarks'
  // compute-only twins), the counters' region, the op's flight-recorder record, which stays open
  // until the work ends (a hang or a failure there names this op and the peer), and the trace's
  // op, so that the transfers posted there are this op's.
  const bool skipped = test_hooks::transfers_skipped();
  state->group.impl().completion_thread.submit([state, work = std::move(work), skipped,
                                                region = current_region(), record = scope.keep_record_open(),
                                                op = trace::detail::current_op()] {
    std::exception_ptr failure;
    FlightRecorder::set_current(record);
    try {
      CommRegion counted_in(region);
      trace::detail::CurrentOpGuard traced_as(op);
      at::NoGradGuard no_grad;
      std::optional<test_hooks::SkipTransfers> skip;
      if (skipped) skip.emplace();
      work(*state);
    } catch (...) {
      failure = std::current_exception();
    }
    if (record) FlightRecorder::get().end(record, failure == nullptr);
    FlightRecorder::set_current(nullptr);
    state->complete(std::move(failure));
  });
}

std::shared_ptr<PendingAllReduceState> start_reduction(const at::Tensor& buffer, ReduceOp op,
                                                       const Group& group, Agreement agreement,
                                                       int64_t content, CollectiveKind kind, const char* name,
                                                       std::function<void(PendingAllReduceState&)> finish) {
  TORCH_CHECK_TYPE(buffer.defined() && at::isFloatingType(buffer.scalar_type()),
                   "hyper_parallel::comm::", name, ": expected a floating-point tensor, got ",
                   buffer.defined() ? c10::toString(buffer.scalar_type()) : "an undefined tensor");
  TORCH_CHECK_VALUE(buffer.is_contiguous(), "hyper_parallel::comm::", name,
                    ": expected a contiguous buffer, got strides ", buffer.strides());
  TORCH_CHECK_VALUE(group.size() <= OpTags::kMaxSteps, "hyper_parallel::comm::", name,
                    ": expected a group of at most ", OpTags::kMaxSteps, " ranks, got ", group.size());
  std::ostringstream what;
  what << buffer.scalar_type() << buffer.sizes() << " on " << group.name() << " (started)";
  OpSignature signature{kind,
                        buffer.scalar_type(),
                        {buffer.numel(), static_cast<int64_t>(op == ReduceOp::kAvg)},
                        {"numel", "avg"}};
  signature.content = content;
  OpScope scope(group, signature, what.str(), /*counted=*/true, agreement);
  // Detached: the in-place sums on the completion thread never touch autograd's metadata.
  auto state = std::make_shared<PendingAllReduceState>(buffer.detach().view({-1}), op, group);
  if (group.size() == 1) {
    state->done = true;
    return state;
  }
  state->post_reduce(/*step=*/0);
  complete_on_completion_thread(state, scope, std::move(finish));
  return state;
}

void wait_until_complete(PendingAllReduceState& state, const char* op) {
  const auto start = std::chrono::steady_clock::now();
  {
    std::unique_lock<std::mutex> lock(state.mutex);
    state.cv.wait(lock, [&] { return state.done; });
  }
  record_exposed_wait(op, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  if (state.error) std::rethrow_exception(state.error);
}

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
  detail::wait_until_complete(*state, "pending all_reduce");
}

PendingAllReduce start_all_reduce(const at::Tensor& buffer, ReduceOp op, const Group& group,
                                  Agreement agreement, int64_t content) {
  return PendingAllReduce(detail::start_reduction(buffer, op, group, agreement, content,
                                                  CollectiveKind::kAllReduce, "start_all_reduce",
                                                  [](detail::PendingAllReduceState& s) { s.gather(1); }));
}

}  // namespace hyper_parallel::comm
