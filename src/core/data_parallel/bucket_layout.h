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
  bool row_sparse = false;  // one parameter whose gradient's all-zero rows need not travel
};

/// The caps a layout follows (GradientReducerOptions' bucket_cap_bytes, first_bucket_cap_bytes,
/// grow_first_buckets and shrink_last_buckets).
struct BucketCaps {
  int64_t cap_bytes = 0, first_cap_bytes = 0;
  bool grow_first = false, shrink_last = false;
  std::vector<bool> row_sparse;  // per parameter: a bucket of its own, reduced row-sparse
};

/// params.size() - 1, ..., 1, 0: the order a backward produces the gradients of a model's
/// parameters, as far as their registration tells.
std::vector<int64_t> reverse_order(int64_t count);

/// For each position k of `order`: the gradient bytes of the parameters after it in `order`.
std::vector<int64_t> bytes_after_in_order(const std::vector<at::Tensor>& params,
                                          const std::vector<int64_t>& order);

/// Buckets over `params` taken in `order` (indices, in the order a backward produces their
/// gradients): a new bucket starts where the dtype changes or the next parameter would take the
/// bucket past its cap or either is row-sparse, `first_cap_bytes` for the first bucket and `cap_bytes` for
/// the others (a parameter larger than the cap has a bucket of its own). With `grow_first`, a bucket holds no
/// more than the buckets before it together (at least `first_cap_bytes`), so the first buckets
/// double in size up to the cap. With `shrink_last`, a bucket also
/// holds no more than `bytes_after[k]` (at least `first_cap_bytes`) once it takes the parameter
/// at position k: the gradient bytes the backward produces after that one, so the last buckets
/// shrink toward the backward's end.
std::vector<BucketSpan> lay_out_buckets(const std::vector<at::Tensor>& params,
                                        const std::vector<int64_t>& order,
                                        const std::vector<int64_t>& bytes_after, const BucketCaps& caps);

/// One line naming each bucket's dtype and shapes, which the ranks compare.
std::string describe_buckets(const std::vector<BucketSpan>& buckets, const std::vector<at::Tensor>& params);

}  // namespace hyper_parallel::data_parallel::detail
