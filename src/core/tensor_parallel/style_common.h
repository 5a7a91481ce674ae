#pragma once
// Internal: what the parallel styles (style.cpp, mc2/style.cpp) and loss parallel share: the
// apply preamble, and the redistribution of activations their hooks run.

#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/dtensor/dtensor.h>
#include <hyper_parallel/core/nn/hookable_module.h>
#include <hyper_parallel/core/tensor_parallel/parameter_sharding.h>
#include <hyper_parallel/core/tensor_parallel/style.h>

namespace torch::nn {
class Module;
}

namespace hyper_parallel::tensor_parallel::detail {

/// The module as a HookableModule, or an error naming the style and the module's type.
nn::HookableModule& hookable(const char* style, torch::nn::Module& module);

/// The style's target description of this library's module `module`.
ModuleTarget target_of(nn::HookableModule& hm, torch::nn::Module& module);

/// The apply preamble of a style that changes a module's parameters or forward: the module is
/// one of this library's; then, in the order every front end follows, the style's check_kind,
/// the check that no style has parallelized it yet (a second one would shard already-sharded
/// weights), and the style's check_target; then the parameters are laid out by the style's
/// table (sharded in place, layouts recorded), and the module reads those with a Partial gradient
/// through sum_gradient_on_read (sum_gradients_of_reads). Throws before anything is touched.
nn::HookableModule& sharding_target(const ParallelStyle& style, torch::nn::Module& module,
                                    const dtensor::DeviceMesh& mesh, std::optional<int64_t> src_data_rank);

/// Makes `hm`'s forward read its parameters `names` (of `parameters`, the module's own) through
/// sum_gradient_on_read. A forward with grad that did not read one of them that requires grad
/// through HookableModule::parameter (a HookableModule of the user's that reads the member
/// itself) is a c10::ValueError at its end: its gradient would be this rank's part only.
void sum_gradients_of_reads(const std::string& style, nn::HookableModule& hm, const std::string& module_type,
                            const dtensor::DeviceMesh& mesh,
                            const std::vector<std::pair<std::string, at::Tensor>>& parameters,
                            const std::vector<std::string>& names);

/// The whole output width of a module sharding_target laid out, from its weight's recorded
/// global shape: a Linear's out_features, an Embedding's embedding_dim.
int64_t output_features(torch::nn::Module& module, nn::ModuleKind kind);

/// A column layer's Shard(-1) output redistributed to `output_layouts`. `features`: the layer's
/// whole output width, which an uneven split needs (without it the shards are taken as even).
at::Tensor prepare_column_output(const char* style, const at::Tensor& output, const dtensor::DeviceMesh& mesh,
                                 const dtensor::Placement& output_layouts, bool use_local_output,
                                 std::optional<int64_t> features);

/// The rows of `table` whose parameter the module has (`parameters`), in table order.
std::vector<ParameterSharding> shard_each(const std::vector<std::string>& parameters,
                                          std::vector<ParameterSharding> table);

/// The DTensor a tagged input carries, else `local` read with `layout` (and the global `shape`,
/// if given; else even shards).
dtensor::DTensor as_dtensor(const at::Tensor& local, const dtensor::DeviceMesh& mesh,
                            const dtensor::Placement& layout,
                            const std::optional<std::vector<int64_t>>& shape = std::nullopt);
/// `local` (read as `from`, of the global `shape` if given, unless tagged) redistributed to `to`;
/// tagged unless use_local_output.
at::Tensor prepare(const at::Tensor& local, const dtensor::DeviceMesh& mesh, const dtensor::Placement& from,
                   const dtensor::Placement& to, bool use_local_output,
                   const std::optional<std::vector<int64_t>>& shape = std::nullopt);
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
/// sum over ranks is the full lookup. The rank holding row `padding_idx` gives it no gradient.
at::Tensor rowwise_embedding(const at::Tensor& ids, const at::Tensor& weight, int64_t vocab_size,
                             const dtensor::DeviceMesh& mesh, const dtensor::Placement& output,
                             bool use_local_output, std::optional<int64_t> padding_idx = std::nullopt);
/// An MC2 column layer's input: kept sequence-sharded (the fused op gathers); every rank must
/// hold the same number of tokens, which the global shape (exact for tagged inputs) tells.
at::Tensor sequence_sharded_input(const char* style, const at::Tensor& local, const dtensor::DeviceMesh& mesh,
                                  const dtensor::Placement& layout);

/// PrepareModuleInput / PrepareModuleOutput's construction check: lists of the same length,
/// unset at the same positions (c10::ValueError otherwise).
void check_layout_lists(const char* style, const char* a_name, const LayoutList& a, const char* b_name,
                        const LayoutList& b);
/// Each tensor converted from its layout in `from` to the one in `to` (unset: left alone); a
/// count other than the lists' is a c10::ValueError.
std::vector<at::Tensor> convert_all(const char* style, const char* what, std::vector<at::Tensor> xs,
                                    const dtensor::DeviceMesh& mesh, const LayoutList& from,
                                    const LayoutList& to, bool use_local_output);

/// This rank's chunk [start, start + size) of a vocabulary sharded over a 1-d mesh, and global
/// ids mapped into it: `outside` marks ids another rank holds; their local id is 0.
struct VocabShard {
  int64_t start, size;
  at::Tensor local_ids, outside;
};
VocabShard vocab_shard(const at::Tensor& ids, int64_t vocab_size, const dtensor::DeviceMesh& mesh);

}  // namespace hyper_parallel::tensor_parallel::detail
