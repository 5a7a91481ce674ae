#pragma once
// Internal: the order in which a root's fully_shard groups run, which implicit prefetch follows.

#include <memory>
#include <vector>

#include <hyper_parallel/core/fully_shard/param_group.h>

namespace hyper_parallel::fully_shard {
namespace detail {

// The order in which the groups of one root ran their forwards: each group's first use in a pass
// (the next group to gather in the forward) and its last (the reverse of the backward's order).
// Implicit prefetch, as FSDP2's: the next group's all-gather travels while this one computes.
struct PassOrder {
  using Weak = std::weak_ptr<ParamGroup::Impl>;
  struct Sequence {
    std::vector<Weak> previous, current;
    // A group seen again begins the next pass.
    void record(const std::shared_ptr<ParamGroup::Impl>& g) {
      for (const auto& w : current) {
        if (w.lock() == g) {
          previous = std::move(current);
          current.clear();
          break;
        }
      }
      current.push_back(g);
    }
  };
  Sequence first_use, last_use;

  static std::shared_ptr<ParamGroup::Impl> neighbour(const std::vector<Weak>& order,
                                                     const std::shared_ptr<ParamGroup::Impl>& g, int step) {
    for (size_t i = 0; i < order.size(); ++i) {
      if (order[i].lock() != g) continue;
      const auto j = static_cast<int64_t>(i) + step;
      return j >= 0 && j < static_cast<int64_t>(order.size()) ? order[j].lock() : nullptr;
    }
    return nullptr;
  }
  // The group whose forward followed g's first use in the last pass.
  std::shared_ptr<ParamGroup::Impl> next_forward(const std::shared_ptr<ParamGroup::Impl>& g) const {
    return neighbour(first_use.previous, g, +1);
  }
  // The group whose backward follows g's in this pass (the one whose forward ended before g's).
  std::shared_ptr<ParamGroup::Impl> next_backward(const std::shared_ptr<ParamGroup::Impl>& g) const {
    return neighbour(last_use.current, g, -1);
  }
};

}  // namespace detail

}  // namespace hyper_parallel::fully_shard
