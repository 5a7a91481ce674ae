#include "flat_layout.h"

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm/chunks.h>

namespace hyper_parallel::fully_shard::detail {

FlatLayout::FlatLayout(std::vector<std::vector<int64_t>> shapes, int64_t ranks, int64_t rank)
    : shapes_(std::move(shapes)), ranks_(ranks), rank_(rank) {
  for (const auto& shape : shapes_) {
    int64_t row = 1;
    for (size_t d = 1; d < shape.size(); ++d) row *= shape[d];
    rows_.push_back(shape[0]);
    row_elements_.push_back(row);
    padded_rows_.push_back(comm::chunk_size(shape[0], ranks, 0));
    offsets_.push_back(flat_elements_);
    flat_elements_ += padded_rows_.back() * row;
  }
}

at::Tensor FlatLayout::shard_of(const at::Tensor& full, int64_t i) const {
  return full
      .narrow(0, comm::chunk_offset(rows_[i], ranks_, rank_), comm::chunk_size(rows_[i], ranks_, rank_))
      .contiguous()
      .clone();
}

int64_t FlatLayout::local_elements(int64_t i) const {
  return comm::chunk_size(rows_[i], ranks_, rank_) * row_elements_[i];
}

std::vector<int64_t> FlatLayout::local_shape(int64_t i) const {
  auto shape = shapes_[i];
  shape[0] = comm::chunk_size(rows_[i], ranks_, rank_);
  return shape;
}

at::Tensor FlatLayout::local(const at::Tensor& flat, int64_t i) const {
  return flat.narrow(0, offsets_[i], local_elements(i));
}

at::Tensor FlatLayout::full(const at::Tensor& gathered, int64_t i) const {
  return gathered.view({ranks_, flat_elements_})
      .narrow(1, offsets_[i], padded_rows_[i] * row_elements_[i])
      .reshape({ranks_ * padded_rows_[i], row_elements_[i]})
      .narrow(0, 0, rows_[i])
      .view(shapes_[i]);
}

at::Tensor FlatLayout::padded_blocks(const at::Tensor& whole, int64_t i) const {
  auto padded = at::zeros({ranks_ * padded_rows_[i], row_elements_[i]}, whole.options());
  padded.narrow(0, 0, rows_[i]).copy_(whole.reshape({rows_[i], row_elements_[i]}));
  return padded.view({ranks_, padded_rows_[i] * row_elements_[i]});
}

}  // namespace hyper_parallel::fully_shard::detail
