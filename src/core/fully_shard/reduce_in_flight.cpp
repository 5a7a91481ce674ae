#include "reduce_in_flight.h"

#include <deque>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm/collectives.h>

namespace hyper_parallel::fully_shard::detail {
namespace {

std::deque<std::weak_ptr<ReduceInFlight>>& reduces_in_flight() {
  static std::deque<std::weak_ptr<ReduceInFlight>> in_flight;  // the backward's thread only
  return in_flight;
}

}  // namespace

const at::Tensor& ReduceInFlight::wait() {
  if (result.defined()) return result;
  auto reduced = unreduced.defined() ? unreduced : pending.wait();
  if (replicate && replicate->size() > 1)
    reduced = comm::all_reduce(reduced, comm::ReduceOp::kAvg, *replicate);
  result = scale == 1.0 ? reduced : reduced * scale;
  return result;
}

void bound_reduces_in_flight() {
  auto& q = reduces_in_flight();
  while (!q.empty()) {
    auto oldest = q.front().lock();
    if (oldest && !oldest->result.defined() && q.size() < kMaxReducesInFlight) return;
    q.pop_front();
    if (oldest) oldest->wait();
  }
}

void track_reduce_in_flight(const std::shared_ptr<ReduceInFlight>& reduce) {
  reduces_in_flight().push_back(reduce);
}

}  // namespace hyper_parallel::fully_shard::detail
