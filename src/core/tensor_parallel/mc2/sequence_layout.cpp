#include <hyper_parallel/core/tensor_parallel/mc2/sequence_layout.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "../../autograd/attach_backward.h"

namespace hyper_parallel::tensor_parallel {
namespace {

// t.movedim(from, to) in contiguous memory. autograd's movedim would hand the backward a
// permuted view (a transposed gradient for a batch-first activation); this node moves the
// gradient back and hands it on in t's own layout (autograd/gradient_layout.h).
at::Tensor moved_contiguous(const at::Tensor& t, int64_t from, int64_t to) {
  auto moved = t.movedim(from, to);
  if (moved.is_contiguous()) return moved;  // nothing moves in memory: a view, as autograd's
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = moved.contiguous();
  }
  return hyper_parallel::detail::attach_backward(
      t, out, [from, to](const at::Tensor& grad) { return grad.movedim(to, from); },
      "MC2SequenceLayoutBackward");
}

}  // namespace

int64_t normalize_sequence_dim(int64_t sequence_dim, int64_t ndim_leading) {
  const int64_t d = sequence_dim < 0 ? sequence_dim + ndim_leading : sequence_dim;
  TORCH_CHECK(d >= 0 && d < ndim_leading, "MC2Linear sequence_dim=", sequence_dim,
              " is out of range for leading rank ", ndim_leading, ".");
  return d;
}

at::Tensor move_dim_to_front(const at::Tensor& t, int64_t dim) { return moved_contiguous(t, dim, 0); }

at::Tensor move_front_to_dim(const at::Tensor& t, int64_t dim) { return moved_contiguous(t, 0, dim); }

at::Tensor sequence_rows(const at::Tensor& x, int64_t sequence_dim) {
  TORCH_CHECK(x.dim() >= 2,
              "MC2Linear::forward: expected an activation with a sequence and a "
              "feature dim, got ",
              x.sizes());
  TORCH_CHECK(sequence_dim >= 0 && sequence_dim < x.dim() - 1,
              "MC2Linear::forward: expected sequence_dim to be a non-feature dim of the ", x.dim(),
              "-d activation ", x.sizes(), ", got ", sequence_dim);
  return move_dim_to_front(x, sequence_dim).reshape({-1, x.size(-1)});
}

at::Tensor from_sequence_rows(const at::Tensor& rows, const at::Tensor& like, int64_t sequence_dim,
                              int64_t seq_len) {
  auto shape = like.movedim(sequence_dim, 0).sizes().vec();
  shape.front() = seq_len;
  shape.back() = rows.size(1);
  return move_front_to_dim(rows.reshape(shape), sequence_dim);
}

}  // namespace hyper_parallel::tensor_parallel
