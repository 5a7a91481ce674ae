#include <hyper_parallel/core/comm/pending_reduce_scatter.h>

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

// The all-reduce's first phase: each rank ends with its block summed, in rank order.
PendingReduceScatter start_reduce_scatter(const at::Tensor& buffer, ReduceOp op, const Group& group,
                                          Agreement agreement, int64_t content) {
  return PendingReduceScatter(
      detail::start_reduction(buffer, op, group, agreement, content, CollectiveKind::kReduceScatter,
                              "start_reduce_scatter", [](detail::PendingAllReduceState& s) {
                                s.wait_all();
                                detail::sum_in_rank_order(s.partials, s.partials[s.group.rank()], s.op);
                                s.partials.clear();
                              }));
}

}  // namespace hyper_parallel::comm
