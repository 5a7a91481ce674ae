#pragma once
// gather_rows: some rows of a matrix whose rows are sharded over the group, as torch.chunk cuts
// them (rank q holds rows [q c, q c + c_q), c = ceil(rows / P)): fully_shard's embedding forward
// asks for the rows of its step's tokens, not the whole table.
//
// Unfused meaning: all_gather(shard, dim 0).index_select(0, ids), bitwise (rows are copied).
// Algorithm (direct, three rounds, each rank with every other): every rank sends each owner
// how many of its rows it asks for, then their offsets in the owner's shard; each owner sends
// back those rows. A rank receives only the rows it asked for, and sends only the rows asked of
// it. Ids outside [0, rows) on any rank are an error on every rank (the counts carry it), so no
// rank waits for a peer that gave up. Its messages travel on the group's control channel (its
// own connections, in a world with a TCPStore), beside the payload of ops already on the link (a
// forward's prefetched gathers) rather than behind it: the caller waits for the rows at once.
//
// Contract: as every collective (process_group.h); all ranks call it in the same order with the
// same rows, cols and dtype (their ids may differ).

#include <cstdint>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/process_group.h>

namespace hyper_parallel::comm {

/// Usage:
///   // weight_shard: this rank's torch.chunk piece of a [vocab, dim] table
///   auto ids = std::get<0>(at::_unique(tokens.reshape({-1}), /*sorted=*/true));
///   at::Tensor rows = gather_rows(weight_shard, vocab, ids, group);  // [ids.size(0), dim]
/// `shard`: [chunk_size(rows, P, rank), cols], floating point. `ids`: 1-D int64, ascending and
/// unique, each in [0, rows). Returns the rows in ids' order, in shard's dtype. Collective.
/// `content`: the caller's name for the table (OpSignature::content), compared by the agreement.
at::Tensor gather_rows(const at::Tensor& shard, int64_t rows, const at::Tensor& ids, const Group& group,
                       int64_t content = 0);

}  // namespace hyper_parallel::comm
