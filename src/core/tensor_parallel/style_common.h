#pragma once
// Internal: what the parallel styles (style.cpp, mc2_style.cpp) and loss parallel share: the
// apply preamble, parameter sharding, and the redistribution of activations in hooks.

#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/dtensor/dtensor.h>
#include <hyper_parallel/core/nn/hookable_module.h>

namespace torch::nn {
class Module;
}

namespace hyper_parallel::tensor_parallel::detail {

/// The module as a HookableModule, or an error naming the style and the module's type.
nn::HookableModule& hookable(const char* style, torch::nn::Module& module);

/// What a sharding style accepts: module kinds (empty: any), named for the error message.
struct ModuleKinds {
  std::vector<nn::ModuleKind> kinds;
  const char* expected;  // e.g. "hyper_parallel::nn::Linear or nn::Embedding"
  const char* reason;    // e.g. "only those are supported"
};

/// The apply preamble of a style that changes a module's parameters or forward: the module is
/// one of this library's, of an accepted kind, and no style has parallelized it yet (a second
/// one would shard already-sharded weights). Throws before anything is touched.
nn::HookableModule& sharding_target(const char* style, torch::nn::Module& module,
                                    const ModuleKinds& accepted);

/// Replaces a parameter's data by its local shard, in place (the parameter object stays the
/// same): cut from the values of TP rank src_data_rank, or each rank's own copy if nullopt.
void shard_tensor_in_place(const at::Tensor& param, const dtensor::DeviceMesh& mesh,
                           const dtensor::Placements& placements, std::optional<int64_t> src_data_rank);
/// A replicated parameter whose gradient is Partial: a gradient hook sums it over the mesh
/// (counted in CommRegion "grad_sync").
void sum_gradient_over_mesh(const at::Tensor& param, const dtensor::DeviceMesh& mesh);

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
/// `local` (read as `from` unless tagged) redistributed to `to`; tagged unless use_local_output.
at::Tensor prepare(const at::Tensor& local, const dtensor::DeviceMesh& mesh,
                   const dtensor::Placement& from, const dtensor::Placement& to,
                   bool use_local_output);
/// A column-parallel Linear's input: made Replicate (gathered if sharded), its gradient declared
/// Partial (so the gather's backward is a reduce-scatter).
at::Tensor replicate_for_column(const at::Tensor& local, const dtensor::DeviceMesh& mesh,
                                const dtensor::Placement& layout);
/// RowwiseParallel's Linear: x @ W_localᵀ is Partial; reduce it to `output`, then add the bias
/// once.
at::Tensor rowwise_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                          const dtensor::DeviceMesh& mesh, const dtensor::Placement& output,
                          bool use_local_output);
/// RowwiseParallel's Embedding: this rank's rows of the table; ids outside look up zeros, so the
/// sum over ranks is the full lookup.
at::Tensor rowwise_embedding(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_size,
                             const dtensor::DeviceMesh& mesh, const dtensor::Placement& output,
                             bool use_local_output);
/// An MC2 column layer's input: kept sequence-sharded (the fused op gathers); every rank must
/// hold the same number of tokens, which the global shape (exact for tagged inputs) tells.
at::Tensor sequence_sharded_input(const char* style, const at::Tensor& local,
                                  const dtensor::DeviceMesh& mesh, const dtensor::Placement& layout);

/// Adds an output hook that redistributes the first output from `produced` to `wanted`.
void add_output_hook(nn::HookableModule& module, const dtensor::DeviceMesh& mesh,
                     const dtensor::Placement& produced, const dtensor::Placement& wanted,
                     bool use_local_output);

/// This rank's chunk [start, start + size) of a vocabulary sharded over a 1-d mesh, and global
/// ids mapped into it: `outside` marks ids another rank holds; their local id is 0.
struct VocabShard {
  int64_t start, size;
  at::Tensor local_ids, outside;
};
VocabShard vocab_shard(const at::Tensor& ids, int64_t vocab_size, const dtensor::DeviceMesh& mesh);

}  // namespace hyper_parallel::tensor_parallel::detail
