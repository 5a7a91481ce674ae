#include <hyper_parallel/core/comm/pending_all_gather.h>

#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/p2p.h>

#include "pending_all_reduce_state.h"

namespace hyper_parallel::comm {

PendingAllGather::PendingAllGather(std::shared_ptr<detail::PendingAllReduceState> state)
    : state_(std::move(state)) {}

bool PendingAllGather::is_completed() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done;
}

at::Tensor PendingAllGather::wait() {
  if (state_) {
    auto state = std::move(state_);
    detail::wait_until_complete(*state, "pending all_gather");
    result_ = state->buffer;
  }
  return result_;
}

PendingAllGather start_all_gather(const at::Tensor& input, const Group& group, Agreement agreement,
                                  int64_t content) {
  TORCH_CHECK_VALUE(input.defined(),
                    "hyper_parallel::comm::start_all_gather: expected a tensor, got an undefined one");
  TORCH_CHECK_VALUE(group.size() <= OpTags::kMaxSteps,
                    "hyper_parallel::comm::start_all_gather: expected a group of at most ", OpTags::kMaxSteps,
                    " ranks, got ", group.size());
  const int64_t p = group.size(), r = group.rank(), n = input.numel();
  std::ostringstream what;
  what << input.scalar_type() << input.sizes() << " on " << group.name() << " (started)";
  OpSignature signature{CollectiveKind::kAllGather, input.scalar_type(), {n, p}, {"numel", "ranks"}};
  signature.content = content;
  OpScope scope(group, signature, what.str(), /*counted=*/true, agreement);
  auto out = at::empty({p * n}, input.options().requires_grad(false));
  out.narrow(0, r * n, n).copy_(input.detach().reshape({-1}));
  auto state = std::make_shared<detail::PendingAllReduceState>(out, ReduceOp::kSum, group);
  if (p == 1 || n == 0) {
    state->done = true;
    return PendingAllGather(std::move(state));
  }
  // Receives first, then sends, each rank starting with a different peer.
  for (int64_t q = 0; q < p; ++q) {
    if (q != r) state->receives.push_back(irecv(state->block(q), q, group, state->tags.step(0)));
  }
  for (int64_t s = 1; s < p; ++s) {
    state->sends.push_back(isend(state->block(r), (r + s) % p, group, state->tags.step(0)));
  }
  detail::complete_on_completion_thread(state, scope, [](detail::PendingAllReduceState& s) { s.wait_all(); });
  return PendingAllGather(std::move(state));
}

}  // namespace hyper_parallel::comm
