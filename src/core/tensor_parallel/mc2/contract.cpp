#include <hyper_parallel/core/tensor_parallel/mc2/contract.h>

#include <algorithm>
#include <limits>
#include <sstream>

#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/chunks.h>

namespace hyper_parallel::tensor_parallel {

const char* to_string(MC2Mode mode) { return mode == MC2Mode::kAllGather ? "all_gather" : "reduce_scatter"; }

MC2Mode mc2_mode_from_string(const std::string& mode) {
  if (mode == "all_gather") return MC2Mode::kAllGather;
  if (mode == "reduce_scatter") return MC2Mode::kReduceScatter;
  TORCH_CHECK_VALUE(false,
                    "MC2Linear::configure_mc2: expected mode 'all_gather' or "
                    "'reduce_scatter', got '",
                    mode, "'");
}

std::vector<at::ScalarType> MC2Contract::strict_dtypes() { return {at::kHalf, at::kBFloat16}; }

std::vector<int64_t> MC2Contract::strict_world_sizes() { return {2, 4, 8}; }

MC2Contract MC2Contract::relaxed() {
  return MC2Contract()
      .dtypes({at::kHalf, at::kBFloat16, at::kFloat, at::kDouble})
      .min_k(1)
      .max_k(std::numeric_limits<int64_t>::max())
      .world_sizes({});
}

void MC2Contract::check_dtype(const char* where, at::ScalarType dtype) const {
  if (std::find(dtypes_.begin(), dtypes_.end(), dtype) != dtypes_.end()) return;
  std::ostringstream allowed;
  for (size_t i = 0; i < dtypes_.size(); ++i) allowed << (i ? ", " : "") << dtypes_[i];
  TORCH_CHECK_VALUE(false, where, ": MC2 dtype: expected one of {", allowed.str(), "}, got ", dtype,
                    " (pass MC2Contract::relaxed() to run other dtypes for debugging)");
}

void MC2Contract::check_k(const char* where, const char* what, int64_t k) const {
  TORCH_CHECK_VALUE(k >= min_k_ && k < max_k_, where, ": MC2 ", what, ": expected in [", min_k_, ", ", max_k_,
                    "), got ", k);
}

void MC2Contract::check_world_size(const char* where, int64_t world_size) const {
  if (world_sizes_.empty()) return;  // any
  TORCH_CHECK_VALUE(std::find(world_sizes_.begin(), world_sizes_.end(), world_size) != world_sizes_.end(),
                    where, ": MC2 world_size: expected one of ", c10::IntArrayRef(world_sizes_), ", got ",
                    world_size);
}

const std::vector<MC2ContractedDim>& mc2_contracted_dims(MC2Mode mode) {
  static const std::vector<MC2ContractedDim> column{
      {1, false, "contraction dim k (in_features)"},
      {0, true, "column backward contraction n_local (out_features / world_size)"}};
  // The backward all-gather-matmul multiplies dY [rows, out_features] by W: it contracts over n.
  static const std::vector<MC2ContractedDim> row{{1, true, "contraction dim k (in_features / world_size)"},
                                                 {0, false, "row backward contraction n (out_features)"}};
  return mode == MC2Mode::kAllGather ? column : row;
}

namespace {

void check_weight_rank(const char* where, c10::IntArrayRef shape) {
  TORCH_CHECK_VALUE(shape.size() == 2, where, ": expected a Linear weight [out, in], got ", shape);
}

}  // namespace

void MC2Contract::check_weight(const char* where, MC2Mode mode, c10::IntArrayRef global_weight_shape,
                               int64_t world_size) const {
  check_weight_rank(where, global_weight_shape);
  for (const auto& dim : mc2_contracted_dims(mode)) {
    const int64_t extent = global_weight_shape[dim.weight_dim];
    if (!dim.sharded) {
      check_k(where, dim.what, extent);
      continue;
    }
    // Shards can differ by one under torch.chunk sizes: check every rank's.
    for (int64_t r = 0; r < world_size; ++r)
      check_k(where, dim.what, comm::chunk_size(extent, world_size, r));
  }
}

void MC2Contract::check_local_weight(const char* where, MC2Mode mode,
                                     c10::IntArrayRef local_weight_shape) const {
  check_weight_rank(where, local_weight_shape);
  for (const auto& dim : mc2_contracted_dims(mode))
    check_k(where, dim.what, local_weight_shape[dim.weight_dim]);
}

}  // namespace hyper_parallel::tensor_parallel
