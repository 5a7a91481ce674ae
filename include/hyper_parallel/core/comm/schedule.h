#pragma once
// The schedule engine: every collective and fused op of this library that moves a rank's share
// of a tensor to or from every other rank is one of these schedules of point-to-point transfers.
// The engine owns the tags, the receive buffers, the chunk offsets (torch.chunk sizes), the
// accumulate dtype and the order of transfers; the caller's callback runs on the calling thread
// for each chunk, and that is where a fused op multiplies while the next transfers are in
// flight (transfers progress in the transport's threads).
//
// Vocabulary (docs/architecture.md):
//   block  the rows of a buffer that belong to one rank of the group (block b to rank b);
//   chunk  one of `chunks` torch.chunk pieces of a block, the unit of one transfer;
//   step   one round of transfers.
// A "row" is what the caller makes it: one element for the flat collectives, one token (a row
// of an activation) for the fused matmuls.
//
// Schedules (P ranks, this rank r; next = r + 1, prev = r - 1, mod P):
//   ring all-gather        step s (1 <= s < P) receives the chunks of block r - s from prev and,
//                          except at the last step, forwards each to next as soon as it arrives.
//   ring reduce-scatter    chunk j of block c starts at rank c + 1 and travels the ring, each
//                          rank adding its contribution in the accumulate dtype; at step s rank
//                          r handles block r - s - 1 and holds block r, complete, after step
//                          P - 1. Partial sums travel in the accumulate dtype.
//   direct reduce-scatter  step s (0 <= s < P - 1) computes this rank's partial of block
//                          r + 1 + s and sends it, in the input dtype, straight to its owner;
//                          its own block's partial comes last and never travels. The owner sums
//                          the P partials in the accumulate dtype, in rank order, and rounds
//                          once. For 16-bit inputs this puts the 16-bit minimum on the wire,
//                          half of what the ring's float32 partial sums cost.
//
// Contract: all ranks of the group run the same schedule, in the same order (the collective
// order of process_group.h), with the same layout and width.

#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorOptions.h>

#include <hyper_parallel/core/comm/process_group.h>

namespace hyper_parallel::comm {

/// bfloat16 and float16 accumulate in float32 (the sum is rounded once); other dtypes in their
/// own type.
at::ScalarType accumulate_type(at::ScalarType dtype);

/// The rows of a buffer as one block per rank, each cut into the same number of chunks.
///
/// Usage:
///   BlockLayout layout(std::vector<int64_t>(group.size(), rows_per_rank), /*chunks=*/2);
///   auto c = layout.chunk(buffer, /*block=*/1, /*chunk=*/0);   // a view of buffer's rows
class BlockLayout {
 public:
  /// `block_rows[b]` rows for rank b. The chunk count is capped so that every transfer of one
  /// operation has its own tag (OpTags::kMaxSteps / blocks).
  BlockLayout(std::vector<int64_t> block_rows, int64_t chunks);

  int64_t blocks() const { return static_cast<int64_t>(block_rows_.size()); }
  int64_t chunks() const { return chunks_; }
  int64_t total_rows() const { return block_offset_.back(); }
  int64_t block_rows(int64_t block) const { return block_rows_[block]; }
  /// First row of block `block` in the whole buffer.
  int64_t block_offset(int64_t block) const { return block_offset_[block]; }
  /// Rows of chunk `chunk` of block `block`, and its first row within the block.
  int64_t chunk_rows(int64_t block, int64_t chunk) const;
  int64_t chunk_offset_in_block(int64_t block, int64_t chunk) const;

  /// Views along dim 0: block `block` of a buffer of total_rows(); chunk `chunk` of it; and the
  /// same chunk of a tensor that holds block `block`'s rows only.
  at::Tensor block(const at::Tensor& buffer, int64_t block) const;
  at::Tensor chunk(const at::Tensor& buffer, int64_t block, int64_t chunk) const;
  at::Tensor chunk_of_block(const at::Tensor& block_rows, int64_t block, int64_t chunk) const;

 private:
  std::vector<int64_t> block_rows_, block_offset_;
  int64_t chunks_;
};

/// Called once per chunk, on the calling thread, when that chunk of `block` is in place and has
/// been forwarded: this rank's own block first, then the others in the order they arrive.
using GatheredChunkFn = std::function<void(int64_t block, int64_t chunk, const at::Tensor& rows)>;

/// Called once per chunk, on the calling thread, in ring order. `arrived()` blocks until the
/// partial sum of that chunk from the ranks before this one is here and returns it (in the
/// accumulate dtype); it returns an undefined tensor at step 0, where this rank starts the
/// chunk. The callback adds this rank's contribution and returns the new partial sum (in the
/// accumulate dtype, contiguous): it is forwarded, or, at the last step, it is this rank's
/// result. Calling arrived() after the local work lets that work overlap the transfer.
using ReduceChunkFn =
    std::function<at::Tensor(int64_t block, int64_t chunk, const std::function<at::Tensor()>& arrived)>;

/// Independent work for the calling thread while a collective's transfers are in flight,
/// run exactly once per call (e.g. a fused backward's weight gradient, which no transfer waits
/// for). Empty: nothing.
using InFlightFn = std::function<void()>;

/// Ring all-gather into `gathered` (contiguous, total_rows() rows): block b receives rank b's
/// block. This rank's block `own` (contiguous, block_rows(r) rows, the same row width) leaves
/// at step 0 straight from where it is while it is copied into place. Every receive is posted
/// before the first is waited for, so transfers run ahead of the callbacks as far as the link
/// allows. P - 1 transfers of each chunk. `while_in_flight` runs once this rank has forwarded
/// all it forwards, before it waits for the last step's chunks (P = 1: after the callbacks), so
/// it delays no other rank.
void ring_all_gather(const at::Tensor& own, const at::Tensor& gathered, const BlockLayout& layout,
                     const Group& group, const GatheredChunkFn& on_chunk = {},
                     const InFlightFn& while_in_flight = {});

/// Ring reduce-scatter of rows of `width` columns whose inputs have `input` dtype and device;
/// returns this rank's reduced block, [block_rows(r), width], in the accumulate dtype. P - 1
/// transfers of each chunk, each in the accumulate dtype. `while_in_flight` runs when step 0's
/// partial sums have been sent, before the first arrived partial sum is waited for.
at::Tensor ring_reduce_scatter(const BlockLayout& layout, int64_t width, const at::TensorOptions& input,
                               const Group& group, const ReduceChunkFn& reduce,
                               const InFlightFn& while_in_flight = {});

/// Called once per chunk, on the calling thread: this rank's partial of chunk `chunk` of block
/// `block`, in any floating dtype ([chunk_rows, width]). Remote blocks come first, in the order
/// r + 1, r + 2, ...; this rank's own block last, so its partial may keep more precision (it
/// never travels).
using PartialChunkFn = std::function<at::Tensor(int64_t block, int64_t chunk)>;

/// Direct reduce-scatter of rows of `width` columns: each remote partial travels once, in the
/// `input` dtype, to the rank that owns its block (P - 1 transfers per chunk per rank, in
/// parallel to distinct peers). Returns this rank's reduced block, [block_rows(r), width], in the
/// accumulate dtype, summed in rank order (deterministic, independent of arrival order).
/// `while_in_flight` runs when every remote partial has been sent, before this rank's own
/// partial is computed and the first arrived partial waited for.
at::Tensor direct_reduce_scatter(const BlockLayout& layout, int64_t width, const at::TensorOptions& input,
                                 const Group& group, const PartialChunkFn& partial,
                                 const InFlightFn& while_in_flight = {});

/// Whether reduce-scatters of `dtype` use the direct schedule: bfloat16 and float16 (16 bits on
/// the wire, float32 at the destination). Other dtypes keep the ring.
bool reduces_directly(at::ScalarType dtype);

}  // namespace hyper_parallel::comm
