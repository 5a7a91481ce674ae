#include <hyper_parallel/core/comm/pending_reduce_scatter.h>

#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/p2p.h>

#include "pending_all_reduce_state.h"

namespace hyper_parallel::comm {

PendingReduceScatter::PendingReduceScatter(std::shared_ptr<detail::PendingAllReduceState> state)
    : state_(std::move(state)) {}

bool PendingReduceScatter::is_completed() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done;
}

at::Tensor PendingReduceScatter::wait() {
  if (state_) {
    auto state = std::move(state_);
    detail::wait_until_complete(*state, "pending reduce_scatter");
    result_ = state->block(state->group.rank());
  }
  return result_;
}

PendingReduceScatter start_reduce_scatter(const at::Tensor& buffer, ReduceOp op, const Group& group,
                                          Agreement agreement) {
  TORCH_CHECK_TYPE(buffer.defined() && at::isFloatingType(buffer.scalar_type()),
                   "hyper_parallel::comm::start_reduce_scatter: expected a floating-point tensor, got ",
                   buffer.defined() ? c10::toString(buffer.scalar_type()) : "an undefined tensor");
  TORCH_CHECK_VALUE(buffer.is_contiguous(),
                    "hyper_parallel::comm::start_reduce_scatter: expected a contiguous buffer, got strides ",
                    buffer.strides());
  TORCH_CHECK_VALUE(group.size() <= OpTags::kMaxSteps,
                    "hyper_parallel::comm::start_reduce_scatter: expected a group of at most ",
                    OpTags::kMaxSteps, " ranks, got ", group.size());
  std::ostringstream what;
  what << buffer.scalar_type() << buffer.sizes() << " on " << group.name() << " (started)";
  OpScope scope(group,
                {CollectiveKind::kReduceScatter,
                 buffer.scalar_type(),
                 {buffer.numel(), static_cast<int64_t>(op == ReduceOp::kAvg)},
                 {"numel", "avg"}},
                what.str(), /*counted=*/true, agreement);
  // Detached: the in-place sum on the completion thread never touches autograd's metadata.
  auto state = std::make_shared<detail::PendingAllReduceState>(buffer.detach().view({-1}), op, group);
  if (group.size() == 1) {
    state->done = true;  // the sum and the average of one rank's tensor: itself
    return PendingReduceScatter(std::move(state));
  }
  state->post_reduce(/*step=*/0);
  detail::complete_on_completion_thread(state, scope, [](detail::PendingAllReduceState& s) {
    s.wait_all();
    const int64_t r = s.group.rank();
    detail::sum_in_rank_order(s.partials, s.partials[r], s.op);
    s.partials.clear();
  });
  return PendingReduceScatter(std::move(state));
}

}  // namespace hyper_parallel::comm
