#pragma once
// A PendingReduceScatter for a buffer that is a matrix of `cols` columns with mostly all-zero
// rows (an embedding's gradient under fully_shard: only the rows of the tokens a step saw),
// cut into P equal blocks of whole rows, block b owned by rank b.
//
// Unfused meaning: start_reduce_scatter(buffer, op, group), bitwise.
// Algorithm (on the group's completion thread, so the calling thread never waits for it):
//   1. every rank finds its rows with any bit set and sends every other rank its count per block
//      (P counts), so every rank knows every rank's counts;
//   2. if the busiest rank's rows and indices bound for other ranks are fewer bytes than the
//      direct reduce-scatter sends ((P - 1) / P of the buffer), every rank sends each owner the
//      rows of its block (indices, then values), and the owner sums, in rank order in the
//      accumulate dtype, the rows any rank had in its block, a zero row standing for a rank that
//      had none: the operands of the dense sum, so its bits. Otherwise, the direct reduce-scatter
//      (pending_reduce_scatter.h). Every rank decides alike, from the same counts.
// Rows of this rank's block that no rank had are zero in the result, as the dense sum's are.
//
// Contract: as start_reduce_scatter's; all ranks pass the same numel and cols.

#include <cstdint>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/op.h>
#include <hyper_parallel/core/comm/pending_reduce_scatter.h>
#include <hyper_parallel/core/comm/process_group.h>

namespace hyper_parallel::comm {

/// Usage:
///   // flat: P blocks of [rows_per_rank, dim] (an embedding's padded row blocks)
///   auto pending = start_row_sparse_reduce_scatter(flat, dim, ReduceOp::kAvg, group);
///   at::Tensor mine = pending.wait();  // block r, reduced over every rank
/// `buffer`: contiguous, 1-D, floating point, of P blocks of whole rows of `cols` elements.
/// `content`: the caller's name for what it carries (OpSignature::content).
PendingReduceScatter start_row_sparse_reduce_scatter(const at::Tensor& buffer, int64_t cols, ReduceOp op,
                                                     const Group& group,
                                                     Agreement agreement = Agreement::kPerOp,
                                                     int64_t content = 0);

}  // namespace hyper_parallel::comm
