#pragma once
// MC2Linear: this library's nn::Linear whose forward is an MC2 fused op (mc2_ops.h), trainable
// with the backward of the contract (docs/mc2.md): each fused op's backward runs its dual. Here
// live the contract's limits, the autograd of the fused Linear, the gather shared by column
// layers that read one activation, the forward kernel and the MC2Linear handle.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/tensor_parallel/mc2_ops.h>

namespace torch::nn {
class Module;
}

namespace hyper_parallel::tensor_parallel {

/// The limits the original Ascend kernels impose, enforced by default (fail closed: a call
/// outside them is an error, never a silent fall back to the unfused path).
///
/// Usage (debugging in float32 on CPU):
///   MC2ColwiseParallel(MC2ColwiseParallelOptions().contract(MC2Contract::relaxed()))
struct MC2Contract {
  /// Allowed dtypes; default float16, bfloat16.
  TORCH_ARG(std::vector<at::ScalarType>, dtypes) =
      std::vector<at::ScalarType>{at::kHalf, at::kBFloat16};
  /// Contraction dims k (and the column backward's n_local) must lie in [min_k, max_k).
  TORCH_ARG(int64_t, min_k) = 256;
  TORCH_ARG(int64_t, max_k) = 65535;
  /// Allowed TP world sizes; default 2, 4, 8.
  TORCH_ARG(std::vector<int64_t>, world_sizes) = std::vector<int64_t>{2, 4, 8};

 public:  // TORCH_ARG leaves the section private
  /// The original's limits (the default).
  static MC2Contract strict() { return {}; }
  /// Any floating dtype, any k >= 1, any world size: same semantics, for debugging and tests.
  /// Never chosen automatically.
  static MC2Contract relaxed();

  /// Throws "<where>: MC2 <what>: expected ..., got ..." unless dtype, k and world size fit.
  void check_dtype(const char* where, at::ScalarType dtype) const;
  void check_k(const char* where, const char* what, int64_t k) const;
  void check_world_size(const char* where, int64_t world_size) const;
};

/// Which fused op an MC2Linear runs.
enum class MC2Mode {
  kAllGather,      ///< column-parallel: input sharded on the sequence, output features sharded
  kReduceScatter,  ///< row-parallel: input features sharded, output sharded on the sequence
};
/// "all_gather" / "reduce_scatter", the original system's spelling.
const char* to_string(MC2Mode mode);
/// The mode spelled "all_gather" or "reduce_scatter"; anything else is a ValueError naming it.
MC2Mode mc2_mode_from_string(const std::string& mode);

// ---- Differentiable fused Linear ------------------------------------------------------------

/// Column-parallel: y = all_gather(x) Wᵀ + b on 2-d views. Backward (contract):
/// dX = matmul_reduce_scatter(dY, W), dW = dYᵀ G (G saved from forward), db = Σ_rows dY.
at::Tensor mc2_column_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                             const comm::Group& group, const MC2Options& options = {});
/// Row-parallel: y = reduce_scatter(x Wᵀ) + b on 2-d views. Backward: (dX, dY_full) =
/// all_gather_matmul(dY, W untransposed), dW = dY_fullᵀ X, db = Σ_rows dY_full.
at::Tensor mc2_row_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                          const comm::Group& group, const MC2Options& options = {});

class MC2LinearKernel;

/// A handle on an nn::Linear whose forward runs an MC2 fused op. Converting keeps the module
/// object and its parameters; only the forward changes. In kAllGather mode, a layer whose input
/// is the very activation the previous kAllGather layer just gathered (same storage, view and
/// version, same group) reuses that gather and multiplies without communicating.
///
/// Usage:
///   auto mc2 = MC2Linear::from_linear(*linear);
///   mc2.configure_mc2(MC2Mode::kAllGather, tp_group, /*sequence_dim=*/1);
///   y = linear(x);  // x: [B, S/P, H] -> y: [B, S, out/P]
class MC2Linear {
 public:
  /// Converts `module` (must be a hyper_parallel::nn::Linear) in place; converting an MC2Linear
  /// again returns its existing handle.
  static MC2Linear from_linear(torch::nn::Module& module);
  /// The MC2Linear view of `module`, or nullopt if it was not converted.
  static std::optional<MC2Linear> of(torch::nn::Module& module);
  /// An MC2Linear attached to no module, with the same configuration and forward: the Python
  /// front end's MC2Linear (a torch.nn.Linear) holds one.
  static MC2Linear standalone();

  /// The fused Linear on `x` with weight `w` [out, in] (this rank's shard) and `bias` (may be
  /// undefined), as configured.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) const;

  /// Runs `mode`'s fused op over `group` (its size is the TP world size). sequence_dim indexes
  /// the activation (negative counts from the end).
  void configure_mc2(MC2Mode mode, const comm::Group& group, int64_t sequence_dim,
                     const MC2Contract& contract = {}, const MC2Options& options = {}) const;

  bool is_configured() const;
  MC2Mode mode() const;
  const comm::Group& group() const;
  int64_t world_size() const;
  int64_t sequence_dim() const;
  const MC2Contract& contract() const;
  const MC2Options& options() const;

 private:
  explicit MC2Linear(std::shared_ptr<MC2LinearKernel> kernel) : kernel_(std::move(kernel)) {}
  std::shared_ptr<MC2LinearKernel> kernel_;
};

/// Moves `sequence_dim` of x to the front and flattens to 2-d rows (sequence-major), the layout
/// the fused ops gather and scatter. Flattening [B, S, H] without the move would interleave
/// tokens of different batch rows.
at::Tensor sequence_rows(const at::Tensor& x, int64_t sequence_dim);
/// Inverse of sequence_rows for an output with `seq_len` positions along sequence_dim and the
/// other leading dims of `like`, and `features` columns.
at::Tensor from_sequence_rows(const at::Tensor& rows, const at::Tensor& like, int64_t sequence_dim,
                              int64_t seq_len);

}  // namespace hyper_parallel::tensor_parallel
