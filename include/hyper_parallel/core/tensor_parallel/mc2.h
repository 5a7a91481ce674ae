#pragma once
// MC2 ("matmul + communication"): Linear layers under tensor + sequence parallelism whose
// collective and matmul overlap. Portable decomposition over this library's P2P ring: while one
// sequence chunk is in flight, the matmul of an arrived chunk runs on the calling thread
// (transfers progress in the transport's threads). See shared/reference/mc2-contract.md.
//
//   all_gather_matmul      (column-parallel)  equals  G = all_gather(X, rows); Y = G Wᵀ
//   matmul_reduce_scatter  (row-parallel)     equals  Y = reduce_scatter(X Wᵀ, rows, sum)
// The two are duals: each one's backward runs the other.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <hyper_parallel/core/comm/process_group.h>

namespace torch::nn {
class Module;
}

namespace hyper_parallel::tensor_parallel {

/// How the ring is cut. Usage: MC2Options().chunks_per_rank(4)
struct MC2Options {
  /// Each rank's block of rows travels and is multiplied as this many chunks (torch.chunk
  /// sizes): more chunks pipeline finer (the first matmul starts sooner, the last transfer
  /// hides behind more work) but run smaller GEMMs. Default 2, from bench_mc2 on 2 ranks.
  TORCH_ARG(int64_t, chunks_per_rank) = 2;
};

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

// ---- Fused ops on 2-d local views; W in Linear's (out, in) layout ----------------------------

/// (Y, G) with G = all_gather(x [m, k], rows) of shape [P·m, k] and Y = G Wᵀ [P·m, n]. Every rank
/// passes the same m. Step s multiplies the chunk that arrived at step s-1 while forwarding it.
std::pair<at::Tensor, at::Tensor> all_gather_matmul(const at::Tensor& x, const at::Tensor& w,
                                                    const comm::Group& group,
                                                    const MC2Options& options = {});
/// reduce_scatter(x [M, k_l] Wᵀ, rows, sum) of shape [M/P, n]; M divisible by P. Step s computes
/// the partial product of one destination block while the accumulator for it is in flight;
/// 16-bit inputs accumulate across ranks in float32 and round once.
at::Tensor matmul_reduce_scatter(const at::Tensor& x, const at::Tensor& w, const comm::Group& group,
                                 const MC2Options& options = {});

/// The same rings with an explicit right operand: all_gather(a) @ b and
/// reduce_scatter(a @ b). The backward passes use these (b = W instead of Wᵀ).
std::pair<at::Tensor, at::Tensor> all_gather_mm(const at::Tensor& a, const at::Tensor& b,
                                                const comm::Group& group,
                                                const MC2Options& options = {});
at::Tensor mm_reduce_scatter(const at::Tensor& a, const at::Tensor& b, const comm::Group& group,
                             const MC2Options& options = {});

namespace detail {
/// For benchmarks: the rings of all_gather_matmul / matmul_reduce_scatter with the matmuls left
/// out: the same transfers, chunks, accumulator dtype and schedule, so timing them gives the
/// communication the fused op has to hide. Results are meaningless; not counted as collectives.
void all_gather_matmul_transfers_only(const at::Tensor& x, const at::Tensor& w,
                                      const comm::Group& group, const MC2Options& options = {});
void matmul_reduce_scatter_transfers_only(const at::Tensor& x, const at::Tensor& w,
                                          const comm::Group& group, const MC2Options& options = {});
}  // namespace detail

// ---- Differentiable fused Linear ------------------------------------------------------------

/// Column-parallel: y = all_gather(x) Wᵀ + b on 2-d views. Backward (contract):
/// dX = matmul_reduce_scatter(dY, W), dW = dYᵀ G (G saved from forward), db = Σ_rows dY.
at::Tensor mc2_column_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                             const comm::Group& group, const MC2Options& options = {});
/// Row-parallel: y = reduce_scatter(x Wᵀ) + b on 2-d views. Backward: (dX, dY_full) =
/// all_gather_matmul(dY, W untransposed), dW = dY_fullᵀ X, db = Σ_rows dY_full.
at::Tensor mc2_row_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                          const comm::Group& group, const MC2Options& options = {});

// ---- MC2Linear: this library's nn::Linear, converted in place -------------------------------

class MC2LinearKernel;

/// A handle on an nn::Linear whose forward runs an MC2 fused op. Converting keeps the module
/// object and its parameters; only the forward changes. In "all_gather" mode, a layer whose input
/// is the very activation the previous all_gather-mode layer just gathered (same storage, view
/// and version, same group) reuses that gather and multiplies without communicating.
///
/// Usage:
///   auto mc2 = MC2Linear::from_linear(*linear);
///   mc2.configure_mc2("all_gather", tp_group, tp_group.size(), /*sequence_dim=*/1);
///   y = linear(x);  // x: [B, S/P, H] -> y: [B, S, out/P]
class MC2Linear {
 public:
  /// Converts `module` (must be a hyper_parallel::nn::Linear) in place; converting an MC2Linear
  /// again returns its existing handle.
  static MC2Linear from_linear(torch::nn::Module& module);
  /// The MC2Linear view of `module`, or nullopt if it was not converted.
  static std::optional<MC2Linear> of(torch::nn::Module& module);

  /// mode "all_gather" (column-parallel, input sharded on sequence_dim, output features
  /// sharded) or "reduce_scatter" (row-parallel, input features sharded, output sharded on
  /// sequence_dim). world_size must equal group.size(). sequence_dim indexes the activation
  /// (negative counts from the end).
  void configure_mc2(const std::string& mode, const comm::Group& group, int64_t world_size,
                     int64_t sequence_dim, const MC2Contract& contract = {},
                     const MC2Options& options = {}) const;

  bool is_configured() const;
  const std::string& mode() const;
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
