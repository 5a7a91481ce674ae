#include "held_sums.h"

#include <algorithm>
#include <vector>

#include <torch/csrc/autograd/engine.h>

#include "param_group_impl.h"

namespace hyper_parallel::fully_shard::detail {
namespace {

struct HeldSums {
  std::vector<std::weak_ptr<ParamGroup::Impl>> groups;  // by serial, the order they were made
  bool queued = false;                                  // this backward's reduction is queued
};

HeldSums& held_sums() {
  static HeldSums held;
  return held;
}

}  // namespace

void note_held_sums(const std::shared_ptr<ParamGroup::Impl>& group) {
  auto& groups = held_sums().groups;
  groups.erase(std::remove_if(groups.begin(), groups.end(), [](const auto& w) { return w.expired(); }),
               groups.end());
  const auto at = std::find_if(groups.begin(), groups.end(),
                               [&group](const auto& w) { return w.lock()->serial >= group->serial; });
  if (at == groups.end() || at->lock() != group) groups.insert(at, group);
}

void queue_reduce_of_held_sums() {
  auto& held = held_sums();
  if (held.queued || held.groups.empty()) return;
  held.queued = true;
  // Cleared when the callback is gone too: a backward that failed before its callbacks ran.
  struct Unqueue {
    ~Unqueue() { held_sums().queued = false; }
  };
  torch::autograd::Engine::get_default_engine().queue_callback([unqueue = std::make_shared<Unqueue>()] {
    auto& h = held_sums();
    h.queued = false;
    const auto groups = h.groups;  // a copy: the loop's reductions must not see the list change
    for (const auto& weak : groups) {
      if (auto group = weak.lock()) group->reduce_held_sums();
    }
    auto& kept = h.groups;
    kept.erase(std::remove_if(kept.begin(), kept.end(),
                              [](const auto& w) {
                                auto group = w.lock();
                                return group == nullptr || !group->holds_sums();
                              }),
               kept.end());
  });
}

}  // namespace hyper_parallel::fully_shard::detail
