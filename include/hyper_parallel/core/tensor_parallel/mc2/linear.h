#pragma once
// MC2Linear: the handle on an nn::Linear whose forward runs the fused Linear (fused_linear.h),
// and the forward kernel it installs (sequence layout, shared gathers, the contract's checks).

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
#include <hyper_parallel/core/tensor_parallel/mc2/fused_linear.h>
#include <hyper_parallel/core/tensor_parallel/mc2/ops.h>

namespace torch::nn {
class Module;
}

namespace hyper_parallel::tensor_parallel {

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

  /// Runs `mode`'s fused op over `group` (its size is the TP world size) on activations whose
  /// sequence is leading dim `sequence_dim` (negative counts from the end of the leading dims:
  /// normalize_sequence_dim).
  void configure_mc2(MC2Mode mode, const comm::Group& group, int64_t sequence_dim,
                     const MC2Contract& contract = {}, const MC2Options& options = {}) const;
  /// The original system's signature: `world_size` must equal group.size() (c10::ValueError).
  void configure_mc2(MC2Mode mode, const comm::Group& group, int64_t world_size, int64_t sequence_dim,
                     const MC2Contract& contract = {}, const MC2Options& options = {}) const;

  /// The name errors at forward give the layer, e.g. its module path "layers.0.feed_forward.w1"
  /// (parallelize_module sets it): "MC2Linear(<label>)::forward: ...". The contract's dtype
  /// limit is checked when the layer runs, so a model parallelized in float32 and then cast to
  /// bfloat16 passes it.
  void set_label(std::string label) const;
  const std::string& label() const;

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
