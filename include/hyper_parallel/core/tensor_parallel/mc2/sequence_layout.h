#pragma once
// The layout the fused ops gather and scatter: an activation [..., S, ..., H] as 2-d rows,
// sequence-major. The sequence dim is moved to the front before flattening: flattening a
// batch-first [B, S, H] without the move would interleave tokens of different batch rows.

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace hyper_parallel::tensor_parallel {

/// MC2Linear's sequence dim as an index into an activation's `ndim_leading` leading dims (all
/// but the features): a negative dim counts from the end of them. Out of range is an error
/// (RuntimeError) "MC2Linear sequence_dim=<d> is out of range for leading rank <n>.", as in the
/// original system.
int64_t normalize_sequence_dim(int64_t sequence_dim, int64_t ndim_leading);

/// `t` with dim `dim` moved to the front, the other dims in order; contiguous.
at::Tensor move_dim_to_front(const at::Tensor& t, int64_t dim);
/// The inverse of move_dim_to_front: the front dim moved to `dim`; contiguous.
at::Tensor move_front_to_dim(const at::Tensor& t, int64_t dim);

/// Moves `sequence_dim` (a non-feature dim, non-negative) of x to the front and flattens to 2-d
/// rows [S·rest, H], contiguous.
at::Tensor sequence_rows(const at::Tensor& x, int64_t sequence_dim);
/// Inverse of sequence_rows for an output with `seq_len` positions along sequence_dim, the other
/// leading dims of `like`, and the rows' column count as features; contiguous, as a Linear's
/// output is (so that views of it, e.g. logits.flatten(0, 1), stay views).
at::Tensor from_sequence_rows(const at::Tensor& rows, const at::Tensor& like, int64_t sequence_dim,
                              int64_t seq_len);

}  // namespace hyper_parallel::tensor_parallel
