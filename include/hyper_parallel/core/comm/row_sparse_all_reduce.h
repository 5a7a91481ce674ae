#pragma once
// A PendingAllReduce for a buffer whose leading rows x cols elements are a matrix with mostly
// all-zero rows (an embedding's gradient: only the rows of the tokens a step saw), followed by
// a few dense elements.
//
// Unfused meaning: start_all_reduce(buffer, op, group), bitwise.
// Algorithm (on the group's completion thread, so the calling thread never waits for it):
//   1. every rank finds its rows with any bit set and sends their count to every other rank;
//   2. if the busiest rank's rows and indices, sent to each peer, are fewer bytes than a dense
//      all-reduce sends (2 (P - 1) / P of the buffer), every rank sends its rows (indices, then
//      values, the dense tail appended) to every other rank, and every rank sums, in rank order
//      in the accumulate dtype, the rows any rank sent, a zero row standing for a rank that had
//      none: the operands of the dense sum, so its bits. The union is summed a slice of rows
//      at a time, so the extra memory is the rows received plus P slices, not P copies of the
//      union. Otherwise, the dense two-phase
//      all-reduce (pending_all_reduce.h). Every rank decides alike, from the same counts.
// Rows no rank sent are zero on every rank, and the dense result's are zero too.
//
// Contract: as start_all_reduce's; all ranks pass the same rows and cols.

#include <cstdint>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/op.h>
#include <hyper_parallel/core/comm/pending_all_reduce.h>
#include <hyper_parallel/core/comm/process_group.h>

namespace hyper_parallel::comm {

/// Usage:
///   // grad: [vocab, dim]; buffer: grad's elements, then one flag
///   auto pending = start_row_sparse_all_reduce(buffer, vocab, dim, ReduceOp::kAvg, group);
///   pending.wait();
/// `buffer`: contiguous, 1-D, floating point; its first rows x cols elements are the matrix.
PendingAllReduce start_row_sparse_all_reduce(const at::Tensor& buffer, int64_t rows, int64_t cols,
                                             ReduceOp op, const Group& group,
                                             Agreement agreement = Agreement::kPerOp);

}  // namespace hyper_parallel::comm
