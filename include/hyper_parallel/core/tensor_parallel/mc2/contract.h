#pragma once
// The MC2 contract: which fused op a layer runs (MC2Mode) and the limits the original Ascend
// kernels impose (MC2Contract), with the one table of the weight dims each mode contracts over.
// Enforced by default and fail closed: a call outside the limits is an error, never a silent
// fall back to the unfused path (docs/mc2.md).

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <torch/arg.h>

namespace hyper_parallel::tensor_parallel {

/// Which fused op an MC2 layer runs.
enum class MC2Mode {
  kAllGather,      ///< column-parallel: input sharded on the sequence, output features sharded
  kReduceScatter,  ///< row-parallel: input features sharded, output sharded on the sequence
};
/// "all_gather" / "reduce_scatter", the original system's spelling.
const char* to_string(MC2Mode mode);
/// The mode spelled "all_gather" or "reduce_scatter"; anything else is a ValueError naming it.
MC2Mode mc2_mode_from_string(const std::string& mode);

/// The limits of the original kernels.
///
/// Usage (debugging in float32 on CPU):
///   MC2ColwiseParallel(MC2ColwiseParallelOptions().contract(MC2Contract::relaxed()))
struct MC2Contract {
  /// Allowed dtypes; default float16, bfloat16.
  TORCH_ARG(std::vector<at::ScalarType>, dtypes) = strict_dtypes();
  /// Contraction dims k (and the column backward's n_local) must lie in [min_k, max_k).
  TORCH_ARG(int64_t, min_k) = 256;
  TORCH_ARG(int64_t, max_k) = 65535;
  /// Allowed TP world sizes; default 2, 4, 8.
  TORCH_ARG(std::vector<int64_t>, world_sizes) = strict_world_sizes();

 public:  // TORCH_ARG leaves the section private
  static std::vector<at::ScalarType> strict_dtypes();
  static std::vector<int64_t> strict_world_sizes();
  /// The original's limits (the default).
  static MC2Contract strict() { return {}; }
  /// Any floating dtype, any k >= 1, any world size: same semantics, for debugging and tests.
  /// Never chosen automatically.
  static MC2Contract relaxed();

  /// Throws "<where>: MC2 <what>: expected ..., got ..." (c10::ValueError) unless the dtype, k
  /// and world size fit.
  void check_dtype(const char* where, at::ScalarType dtype) const;
  void check_k(const char* where, const char* what, int64_t k) const;
  void check_world_size(const char* where, int64_t world_size) const;

  /// The contraction dims of a Linear weight [out, in] whose full shape is
  /// `global_weight_shape`, in `mode`, for the shard of every rank of a `world_size`-rank group
  /// (torch.chunk sizes, so every rank reaches the same verdict). The styles run it at apply.
  void check_weight(const char* where, MC2Mode mode, c10::IntArrayRef global_weight_shape,
                    int64_t world_size) const;
  /// The same limits on this rank's shard [out_local, in_local] (a layer configured by hand).
  void check_local_weight(const char* where, MC2Mode mode, c10::IntArrayRef local_weight_shape) const;
};

/// One contraction dim of the contract's table: which dim of the weight [out, in] it is, whether
/// the mode shards it over the group, and its name in messages.
struct MC2ContractedDim {
  int64_t weight_dim;
  bool sharded;
  const char* what;
};
/// The table: the forward contraction, then the backward's.
///   kAllGather:     k = in_features (whole); n_local = out_features / world_size (sharded)
///   kReduceScatter: k = in_features / world_size (sharded); n = out_features (whole)
const std::vector<MC2ContractedDim>& mc2_contracted_dims(MC2Mode mode);

}  // namespace hyper_parallel::tensor_parallel
