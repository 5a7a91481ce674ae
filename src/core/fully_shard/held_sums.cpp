#include "held_sums.h"

#include <algorithm>
#include <vector>

#include <torch/csrc/autograd/engine.h>

#include "param_group_impl.h"

namespace hyper_parallel::fully_shard::detail {
namespace {

struct HeldSums {
  std::vector<std::weak_ptr<ParamGroup::Impl>> groups;  // in the order they first held sums
  bool queued = false;                                  // this backward's reduction is queued
};

HeldSums& held_sums() {
  static HeldSums held;
  return held;
}

}  // namespace

void note_held_sums(const std::shared_ptr<ParamGroup::Impl>& group) {
  auto& groups = held_sums().groups;
  const bool noted =
      std::any_of(groups.begin(), groups.end(), [&group](const auto& w) { return w.lock() == group; });
  if (!noted) groups.push_back(group);
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
    const auto groups = h.groups;  // reduce_held_sums may note groups (a hook's backward)
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
