#include <hyper_parallel/core/tensor_parallel/mc2/sequence_layout.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace hyper_parallel::tensor_parallel {

at::Tensor sequence_rows(const at::Tensor& x, int64_t sequence_dim) {
  TORCH_CHECK(x.dim() >= 2, "MC2Linear::forward: expected an activation with a sequence and a "
              "feature dim, got ", x.sizes());
  TORCH_CHECK(sequence_dim >= 0 && sequence_dim < x.dim() - 1,
              "MC2Linear::forward: expected sequence_dim to be a non-feature dim of the ", x.dim(),
              "-d activation ", x.sizes(), ", got ", sequence_dim);
  return x.movedim(sequence_dim, 0).reshape({-1, x.size(-1)}).contiguous();
}

at::Tensor from_sequence_rows(const at::Tensor& rows, const at::Tensor& like, int64_t sequence_dim,
                              int64_t seq_len) {
  auto shape = like.movedim(sequence_dim, 0).sizes().vec();
  shape.front() = seq_len;
  shape.back() = rows.size(1);
  return rows.view(shape).movedim(0, sequence_dim);
}

}  // namespace hyper_parallel::tensor_parallel
