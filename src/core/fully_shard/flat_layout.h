#pragma once
// Internal: how a fully_shard group's parameters travel. Each parameter is cut on dim 0 into
// torch.chunk pieces, one per rank of the shard dim, each padded to the chunk size (the first
// piece's), so that every rank contributes the same number of elements. A rank's pieces of all
// the group's parameters, one after the other, form its flat buffer: the unit of the group's
// one all-gather (and of its one reduce-scatter, unless it reduces in buckets: a bucket's
// parameters' pieces, one after the other, in the order the bucket lists them).
//
//   rank q's flat buffer:  [ param 0 rows [q c0, q c0 + c0) | param 1 rows [q c1, q c1 + c1) | ... ]
//   (ci = ceil(rows_i / P); rows past the parameter's end are zeros)

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace hyper_parallel::fully_shard::detail {

class FlatLayout {
 public:
  FlatLayout() = default;
  /// The group's parameters' full shapes (before sharding), over `ranks` ranks, seen by `rank`.
  FlatLayout(std::vector<std::vector<int64_t>> shapes, int64_t ranks, int64_t rank);

  /// Elements of one rank's flat buffer.
  int64_t flat_elements() const { return flat_elements_; }
  /// Elements of parameter i's padded piece (the same on every rank).
  int64_t padded_elements(int64_t i) const { return padded_rows_[i] * row_elements_[i]; }
  /// Elements of this rank's piece of parameter i (the padded piece without its padding).
  int64_t local_elements(int64_t i) const;
  /// The shape of this rank's piece of parameter i.
  std::vector<int64_t> local_shape(int64_t i) const;
  /// This rank's piece of parameter i, contiguous (torch.chunk rows: possibly none).
  at::Tensor shard_of(const at::Tensor& full, int64_t i) const;
  /// The elements of this rank's piece of parameter i within a one-rank flat buffer.
  at::Tensor local(const at::Tensor& flat, int64_t i) const;
  /// Parameter i whole, from the all-gathered flat buffers of every rank ([ranks * flat]).
  at::Tensor full(const at::Tensor& gathered, int64_t i) const;
  /// A whole tensor of parameter i's shape as [ranks, padded piece], zeros past its rows.
  at::Tensor padded_blocks(const at::Tensor& whole, int64_t i) const;

 private:
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<int64_t> rows_, row_elements_, padded_rows_, offsets_;
  int64_t ranks_ = 1, rank_ = 0, flat_elements_ = 0;
};

}  // namespace hyper_parallel::fully_shard::detail
