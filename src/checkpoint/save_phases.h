#pragma once
// Internal: the phases of checkpoint::save after the plan, over a group: the staging directory,
// the shard files and the publication. A synchronous save runs them on the calling thread over
// the world; an asynchronous one on its writer thread, over the writer's own group.

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/checkpoint/checkpoint.h>
#include <hyper_parallel/core/comm/process_group.h>

#include "publish.h"
#include "save_plan.h"

namespace hyper_parallel::checkpoint::detail {

/// Writes `data` (one tensor per plan.mine entry) as root/step-<step> and publishes it.
/// Collective over `group`; an error on any rank is raised on every rank.
SaveResult write_and_publish(const char* fn, const std::string& root, const SavePlan& plan,
                             const std::vector<at::Tensor>& data, int64_t step, bool durable,
                             const comm::Group& group);

}  // namespace hyper_parallel::checkpoint::detail
