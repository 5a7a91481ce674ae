#pragma once
// The trainable fused Linear: its autograd (each fused op's backward runs its dual, docs/mc2.md)
// and MC2Linear, the handle on an nn::Linear whose forward runs it.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/tensor_parallel/mc2/contract.h>
#include <hyper_parallel/core/tensor_parallel/mc2/ops.h>

namespace torch::nn {
class Module;
}

namespace hyper_parallel::tensor_parallel {

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

}  // namespace hyper_parallel::tensor_parallel
