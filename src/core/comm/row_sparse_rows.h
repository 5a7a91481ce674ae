#pragma once
// Internal: the steps the row-sparse all-reduce and reduce-scatter share. A matrix whose rows are
// mostly all-zero (an embedding's gradient) travels as its rows with any bit set, and the
// receiver sums, in rank order, the union of the rows any rank sent: each rank's rows, with a
// zero row where it had none, are the operands of the dense sum, so the result has its bits.

#include <vector>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/collectives.h>

namespace hyper_parallel::comm::detail {

/// The ascending indices of `matrix`'s rows with any bit set (a row of -0.0 counts: the dense
/// sum's bits depend on it).
at::Tensor rows_with_bits(const at::Tensor& matrix);

/// Writes into `matrix`'s rows `any_rank` (ascending) the sum in rank order of every rank's rows:
/// rank q sent rows[q] for the positions positions[q] (ascending) of any_rank, and a zero row
/// stands for a row it did not send. Summed a slice of rows at a time (P slices of about 2^17
/// elements, not P copies of the union); kAvg divides by P, as the dense sum does.
void sum_union_in_row_slices(const at::Tensor& matrix, const at::Tensor& any_rank,
                             const std::vector<at::Tensor>& positions, const std::vector<at::Tensor>& rows,
                             ReduceOp op);

}  // namespace hyper_parallel::comm::detail
