#pragma once
// Internal helpers shared by the styles (style.cpp, mc2_style.cpp) and loss parallel.

#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/dtensor/dtensor.h>
#include <hyper_parallel/core/tensor_parallel/hookable_module.h>

namespace torch::nn {
class Module;
}

namespace hyper_parallel::tensor_parallel::detail {

/// The module as a HookableModule, or an error naming the style and the module's type.
HookableModule& hookable(const char* style, torch::nn::Module& module);
/// This rank's chunk [start, start + size) of a vocabulary sharded over a 1-d mesh, and global
/// ids mapped into it: `outside` marks ids another rank holds; their local id is 0.
struct VocabShard {
  int64_t start, size;
  at::Tensor local_ids, outside;
};
VocabShard vocab_shard(const at::Tensor& ids, int64_t vocab_size, const dtensor::DeviceMesh& mesh);

/// A module's parameters and forward are changed by at most one style (Colwise, Rowwise,
/// SequenceParallel or an MC2 style); a second one would shard already-sharded weights.
void check_not_parallelized(const char* style, torch::nn::Module& module);
/// Styles act on one mesh dim: the TP mesh.
void check_tp_mesh(const char* style, const dtensor::DeviceMesh& mesh);
/// Replaces parameter `name` of `module` by its local shard (cut from the values of TP rank
/// src_data_rank, or of each rank's own copy if nullopt) and records the layout.
void shard_parameter(torch::nn::Module& module, const std::string& name,
                     const dtensor::DeviceMesh& mesh, const dtensor::Placements& placements,
                     std::optional<int64_t> src_data_rank);
/// A replicated parameter whose gradient is Partial: summed over the mesh by a gradient hook.
void sync_partial_gradient(torch::nn::Module& module, const std::string& name,
                           const dtensor::DeviceMesh& mesh, std::optional<int64_t> src_data_rank);
/// The DTensor a tagged input carries, else `local` read with `layout`.
dtensor::DTensor as_dtensor(const at::Tensor& local, const dtensor::DeviceMesh& mesh,
                            const dtensor::Placement& layout);
/// Adds an output hook that redistributes the first output from `produced` to `wanted`.
void add_output_hook(HookableModule& module, const dtensor::DeviceMesh& mesh,
                     const dtensor::Placement& produced, const dtensor::Placement& wanted,
                     bool use_local_output);
/// `local` (read as `from` unless tagged) redistributed to `to`; tagged unless use_local_output.
at::Tensor prepare(const at::Tensor& local, const dtensor::DeviceMesh& mesh,
                   const dtensor::Placement& from, const dtensor::Placement& to,
                   bool use_local_output);

}  // namespace hyper_parallel::tensor_parallel::detail
