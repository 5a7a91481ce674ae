#pragma once
// Collectives built on point-to-point transfers (Gloo 1.13 has no bf16 collectives, no
// reduce_scatter, and its all_gather is ~15x slower than P2P). all_gather, reduce_scatter and
// all_reduce are schedules of the engine in schedule.h.
//
// Vocabulary (schedule.h): the tensor is split along `dim` into one block per rank (torch.chunk
// sizes unless given); each block travels in chunks, so a rank forwards the first chunks of a
// block while the last ones arrive. P ranks need P - 1 steps.
//
// Contract: all ranks of the group call the same collective, in the same order, with matching
// shapes. Supported dtypes: float32, float64, bfloat16, float16, int64, int32; the collectives that
// only move data (all_gather, all_to_all, broadcast) also int16, int8, uint8 and bool.
// bfloat16/float16 reductions accumulate in float32 and round once.

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <hyper_parallel/core/comm/chunks.h>
#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/comm/schedule.h>

namespace hyper_parallel::comm {

enum class ReduceOp { kSum, kAvg };
const char* to_string(ReduceOp op);

/// Concatenation along `dim` of every rank's `input`. `sizes[r]` is rank r's extent along dim;
/// empty means all equal to this rank's. Ring, P-1 steps. `while_in_flight` (independent work,
/// e.g. a backward's deferred weight gradients) runs once this rank has forwarded everything it
/// forwards, while the last blocks travel.
at::Tensor all_gather(const at::Tensor& input, int64_t dim, const Group& group, c10::IntArrayRef sizes = {},
                      const InFlightFn& while_in_flight = {});

/// Reduction over ranks of `input`, split along `dim`; rank r gets block r. `sizes` splits dim
/// (must sum to its extent); empty means chunk_sizes(extent, P). Ring, P-1 steps.
at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim, ReduceOp op, const Group& group,
                          c10::IntArrayRef sizes = {});

/// Reduction over ranks, result on every rank (ring reduce_scatter then ring all_gather).
/// `content`: the caller's name for what `input` holds (OpSignature::content; 0: unnamed).
at::Tensor all_reduce(const at::Tensor& input, ReduceOp op, const Group& group, int64_t content = 0);

/// Splits `input` along split_dim (sizes `split_sizes`, default chunk_sizes) and sends piece j to
/// rank j; returns the pieces received from every rank concatenated along concat_dim.
/// `recv_concat_sizes[j]` is rank j's extent along concat_dim (default: this rank's).
at::Tensor all_to_all(const at::Tensor& input, int64_t split_dim, int64_t concat_dim, const Group& group,
                      c10::IntArrayRef split_sizes = {}, c10::IntArrayRef recv_concat_sizes = {});

/// `input` of rank `src` (group rank) on every rank; other ranks pass a tensor of the same shape
/// and dtype (its values are ignored).
at::Tensor broadcast(const at::Tensor& input, int64_t src, const Group& group);

void barrier(const Group& group);

/// Every rank's `value`, in group-rank order (two all_gathers: the lengths, then the bytes).
/// For agreeing on descriptions, plans and errors, not for payload.
std::vector<std::string> all_gather_strings(const std::string& value, const Group& group);

}  // namespace hyper_parallel::comm
