#pragma once
// Internal: how this library's tags are laid out above the user range (p2p.h's kMaxUserTag):
//   kControlTag                                   every group's control messages (signatures on its
//                                                 control channel; the channel's name, drawn on
//                                                 the group's own connections)
//   kInternalTagBase + block · OpTags::kMaxSteps   the steps of one operation's tag block
// Blocks wrap after kOpBlocks operations on a group; operations that far apart never overlap.

#include <cstdint>

#include <hyper_parallel/core/comm/p2p.h>

namespace hyper_parallel::comm::detail {

constexpr int64_t kInternalTagBase = int64_t{1} << 30;
constexpr int64_t kOpBlocks = int64_t{1} << 19;
constexpr int kControlTag = static_cast<int>(kInternalTagBase - 1);
static_assert(kInternalTagBase + kOpBlocks * OpTags::kMaxSteps < (int64_t{1} << 31));

}  // namespace hyper_parallel::comm::detail
