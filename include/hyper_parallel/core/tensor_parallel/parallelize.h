#pragma once
// parallelize_module: applies parallel styles to a module tree.

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <hyper_parallel/core/dtensor/device_mesh.h>
#include <hyper_parallel/core/tensor_parallel/style.h>

namespace torch::nn {
class Module;
}

namespace hyper_parallel::tensor_parallel {

/// Tensor parallelism runs on a 1-d mesh: throws "<where>: expected a 1-d TP mesh, got ..."
/// (naming the fix: slice a larger mesh by name) otherwise. Used by every entry point that
/// takes the TP mesh.
void check_tp_mesh(const char* where, const dtensor::DeviceMesh& mesh);

/// Ordered (key, style) pairs. A key is a module path split on '.', each token glob-matched
/// (*, ?, [1-2]) against child names at that depth; "" is the module itself.
using ParallelizePlan = std::vector<std::pair<std::string, std::shared_ptr<ParallelStyle>>>;

/// Applies `style` to `module`. The mesh must be 1-d (the TP mesh; slice a 2-d mesh by name).
/// `src_data_rank`: the TP rank whose parameter values are sharded (as in distribute_tensor);
/// nullopt: every rank already holds the full parameters and shards its own copy.
void parallelize_module(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                        const ParallelStyle& style, std::optional<int64_t> src_data_rank = 0);

/// Applies each style to every submodule its key matches, in plan order. A key matching nothing,
/// or an empty plan, is reported with a warning (TORCH_WARN), never silently ignored.
///
/// Usage:
///   parallelize_module(*model, tp_mesh, {
///       {"layers.*.feed_forward.w1", std::make_shared<ColwiseParallel>()},
///       {"layers.*.feed_forward.w2", std::make_shared<RowwiseParallel>()}});
void parallelize_module(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                        const ParallelizePlan& plan, std::optional<int64_t> src_data_rank = 0);

}  // namespace hyper_parallel::tensor_parallel
