#pragma once
// Internal: how a GradientReducer lays its parameters out in buckets.

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace hyper_parallel::data_parallel::detail {

/// One bucket: parameters (indices) of one dtype, each with the element count it had when laid
/// out, at an element offset of a flat buffer.
struct BucketSpan {
  std::vector<int64_t> params;
  std::vector<int64_t> offsets, numels;
  int64_t numel = 0;
};

/// Buckets over `params` in reverse order: a new bucket starts where the dtype changes or the
/// next parameter would take the bucket past its cap, `first_cap_bytes` for the first bucket and
/// `cap_bytes` for the others (a parameter larger than the cap has a bucket of its own).
std::vector<BucketSpan> lay_out_buckets(const std::vector<at::Tensor>& params, int64_t cap_bytes,
                                        int64_t first_cap_bytes);

/// One line naming each bucket's dtype and shapes, which the ranks compare.
std::string describe_buckets(const std::vector<BucketSpan>& buckets, const std::vector<at::Tensor>& params);

}  // namespace hyper_parallel::data_parallel::detail
