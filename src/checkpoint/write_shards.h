#pragma once
// Internal, save phase 2: each rank writes the regions it owns as one safetensors file,
// dir/rank<R>.safetensors (tensor names are the state's keys: a rank holds at most one region of
// a key), computing each shard's crc32 as it writes.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "index.h"
#include "save_plan.h"

namespace hyper_parallel::checkpoint::detail {

/// "rank<R>.safetensors".
std::string rank_file_name(int64_t rank);

/// The tensors this rank writes, in plan.mine order: the state's own tensors, contiguous (a copy
/// only where a tensor is not), on the CPU.
std::vector<at::Tensor> tensors_to_write(const State& state, const SavePlan& plan);

/// Writes `data` (one tensor per plan.mine entry) into `path`, fsynced when `durable`; returns
/// where each shard lies in the file. `halfway` runs after the first half of the tensors is
/// written (the async_write fault point).
std::vector<ShardInfo> write_rank_file(const char* fn, const std::string& path, const SavePlan& plan,
                                       const std::vector<at::Tensor>& data, int64_t rank, int64_t step,
                                       bool durable, const std::function<void()>& halfway = {});

}  // namespace hyper_parallel::checkpoint::detail
