#pragma once
// Internal, save phase 1: the plan. Every rank describes the region of every key it holds; the
// descriptions are gathered so that all ranks agree on the keys, on who writes each region (its
// lowest global rank: a replicated tensor or a DP replica's shard is written once) and on the
// temporary directory's id, which rank 0 picks.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <hyper_parallel/checkpoint/checkpoint.h>
#include <hyper_parallel/core/comm/process_group.h>

#include "index.h"
#include "layout.h"

namespace hyper_parallel::checkpoint::detail {

struct SavePlan {
  /// Every key in state order, with its dtype and global shape (no shards).
  std::vector<std::pair<std::string, TensorInfo>> keys;
  /// This rank's region of each key.
  std::vector<Region> regions;
  /// Indices (into keys) of the regions this rank writes.
  std::vector<size_t> mine;
  /// Tensor bytes of the whole checkpoint.
  int64_t total_bytes = 0;
  /// The id of this save's temporary directory, the same on every rank.
  std::string nonce;
};

/// Runs each entry's before_save, describes this rank's regions and agrees on the plan over
/// `group`. Collective; an error on any rank (a bad layout, another step, keys that differ,
/// regions that overlap or leave a gap) is raised on every rank.
SavePlan agree_on_plan(const char* fn, const State& state, int64_t step, const comm::Group& group);

}  // namespace hyper_parallel::checkpoint::detail
