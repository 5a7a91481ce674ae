#include "reduce_in_flight.h"

#include <algorithm>
#include <deque>
#include <vector>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm/collectives.h>

namespace hyper_parallel::fully_shard::detail {
namespace {

struct InFlight {
  const void* group;
  std::weak_ptr<ReduceInFlight> reduce;
  bool pending() const {
    auto r = reduce.lock();
    return r && !r->result.defined();
  }
};

std::deque<InFlight>& reduces_in_flight() {
  static std::deque<InFlight> in_flight;  // the backward's thread only, oldest first
  return in_flight;
}

// The reductions in flight that started before `reduce`, oldest first, finished (none if it is
// no longer listed: it was the oldest).
void finish_started_before(const ReduceInFlight* reduce) {
  std::vector<std::shared_ptr<ReduceInFlight>> older;
  for (const auto& e : reduces_in_flight()) {
    auto r = e.reduce.lock();
    if (r.get() == reduce) {
      for (const auto& o : older) o->wait();
      return;
    }
    if (r) older.push_back(std::move(r));
  }
}

size_t groups_in_flight(const std::deque<InFlight>& q) {
  std::vector<const void*> groups;
  for (const auto& e : q) {
    if (e.pending() && std::find(groups.begin(), groups.end(), e.group) == groups.end())
      groups.push_back(e.group);
  }
  return groups.size();
}

}  // namespace

const at::Tensor& ReduceInFlight::wait() {
  if (result.defined()) return result;
  const bool all_reduces = !held && replicate && replicate->size() > 1;
  if (all_reduces) finish_started_before(this);
  auto reduced = unreduced.defined() ? unreduced : pending.wait();
  if (partial.defined()) reduced = reduced + partial;
  if (all_reduces) reduced = comm::all_reduce(reduced, op, *replicate, content);
  if (flags > 0) {
    const auto any = reduced.narrow(0, reduced.numel() - flags, flags).ne(0).contiguous();
    const auto* bits = any.data_ptr<bool>();
    reached_anywhere.assign(bits, bits + flags);
  }
  result = held || scale == 1.0 ? reduced : reduced * scale;
  return result;
}

void bound_reduces_in_flight(const void* group) {
  auto& q = reduces_in_flight();
  auto drop_finished = [&q] {
    while (!q.empty() && !q.front().pending()) q.pop_front();
  };
  drop_finished();
  for (const auto& e : q) {
    if (e.group == group && e.pending()) return;
  }
  while (groups_in_flight(q) >= kMaxReducesInFlight) {
    auto oldest = q.front().reduce.lock();
    q.pop_front();
    if (oldest) oldest->wait();
    drop_finished();
  }
}

void track_reduce_in_flight(const void* group, const std::shared_ptr<ReduceInFlight>& reduce) {
  reduces_in_flight().push_back({group, reduce});
}

}  // namespace hyper_parallel::fully_shard::detail
