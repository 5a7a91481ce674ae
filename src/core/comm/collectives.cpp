#include <hyper_parallel/core/comm/collectives.h>

#include <numeric>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/counters.h>
#include <hyper_parallel/core/comm/p2p.h>

#include "group_impl.h"

namespace hyper_parallel::comm {
namespace {

void check_dtype(const char* fn, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), "hyper_parallel::comm::", fn, ": expected a defined tensor, got undefined");
  switch (t.scalar_type()) {
    case at::kFloat: case at::kDouble: case at::kBFloat16: case at::kHalf:
    case at::kLong: case at::kInt:
      return;
    default:
      TORCH_CHECK(false, "hyper_parallel::comm::", fn,
                  ": expected dtype float32, float64, bfloat16, float16, int64 or int32, got ",
                  t.scalar_type());
  }
}

int64_t normalize_dim(const char* fn, int64_t dim, int64_t ndim) {
  TORCH_CHECK(ndim >= 1, "hyper_parallel::comm::", fn, ": expected a tensor with at least 1 dim, got a scalar");
  TORCH_CHECK(dim >= -ndim && dim < ndim, "hyper_parallel::comm::", fn,
              ": expected dim in [", -ndim, ", ", ndim, "), got ", dim);
  return dim < 0 ? dim + ndim : dim;
}

// Float32 accumulation for 16-bit floats: the sum is rounded once, at the end.
at::ScalarType accumulate_type(at::ScalarType t) {
  return (t == at::kBFloat16 || t == at::kHalf) ? at::kFloat : t;
}

void check_reduce_op(const char* fn, ReduceOp op, const at::Tensor& t) {
  TORCH_CHECK(op != ReduceOp::kAvg || at::isFloatingType(t.scalar_type()), "hyper_parallel::comm::",
              fn, ": ReduceOp avg does not support integer dtype ", t.scalar_type(),
              "; use sum and divide");
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> off(sizes.size() + 1, 0);
  std::partial_sum(sizes.begin(), sizes.end(), off.begin() + 1);
  return off;
}

std::string describe(const at::Tensor& t, const Group& g) {
  std::ostringstream s;
  s << t.scalar_type() << t.sizes() << " on " << g.name();
  return s.str();
}

int64_t shard_offset_of(int64_t n, int64_t parts, int64_t j) {
  return std::min(n, j * ((n + parts - 1) / parts));
}

// Segments: each chunk travels as up to kMaxSegments pieces of at least kSegmentBytes, so a
// rank can forward (all-gather) or reduce and forward (reduce-scatter) the first segments of a
// chunk while the last ones are still arriving.
constexpr int64_t kSegmentBytes = int64_t{1} << 20;
constexpr int64_t kMaxSegments = 8;

// Capped so that (P - 1) steps x segments tags fit in one operation's tag block.
int64_t segment_count(int64_t max_chunk_bytes, int64_t world_size) {
  const int64_t max_for_tags = std::max<int64_t>(1, OpTags::kMaxSteps / world_size);
  return std::clamp<int64_t>(max_chunk_bytes / kSegmentBytes, 1, std::min(kMaxSegments, max_for_tags));
}

// Segment j of a contiguous chunk, as a flat view.
at::Tensor segment(const at::Tensor& chunk, int64_t segments, int64_t j) {
  auto flat = chunk.view({-1});
  const int64_t n = flat.numel();
  const int64_t begin = shard_offset_of(n, segments, j), end = shard_offset_of(n, segments, j + 1);
  return flat.narrow(0, begin, end - begin);
}

// Ring all-gather of chunks along dim 0 of a contiguous buffer. This rank's chunk `own` leaves at
// step 0 straight from where it is, while it is copied into its place in `buffer`. Step s
// receives chunk (r - s - 1) from the previous rank and forwards each segment to the next rank
// as soon as it arrives (it is the chunk sent at step s + 1).
void ring_all_gather(const at::Tensor& buffer, const at::Tensor& own,
                     const std::vector<int64_t>& sizes, const Group& group) {
  const int64_t p = group.size(), r = group.rank();
  const auto off = offsets_of(sizes);
  auto own_slot = buffer.narrow(0, off[r], sizes[r]);
  if (p == 1) {
    own_slot.copy_(own.view(own_slot.sizes()));
    return;
  }
  const int64_t row_bytes = buffer.numel() == 0 || buffer.size(0) == 0
                                ? 0
                                : buffer.numel() / buffer.size(0) * buffer.element_size();
  // With two ranks nothing is forwarded, so segments would only add messages.
  const int64_t segments =
      p == 2 ? 1 : segment_count(*std::max_element(sizes.begin(), sizes.end()) * row_bytes, p);
  const auto tags = reserve_tags(group);
  auto tag = [&](int64_t step, int64_t j) { return tags.step(step * segments + j); };
  auto chunk = [&](int64_t c) { return buffer.narrow(0, off[c], sizes[c]); };
  const int64_t next = (r + 1) % p, prev = (r + p - 1) % p;
  std::vector<Work> sends;
  for (int64_t j = 0; j < segments; ++j) sends.push_back(isend(segment(own, segments, j), next, group, tag(0, j)));
  if (own.data_ptr() != own_slot.data_ptr()) own_slot.copy_(own.view(own_slot.sizes()));
  for (int64_t s = 0; s + 1 < p; ++s) {
    auto incoming = chunk((r - s - 1 + 2 * p) % p);
    std::vector<Work> recvs;
    for (int64_t j = 0; j < segments; ++j) recvs.push_back(irecv(segment(incoming, segments, j), prev, group, tag(s, j)));
    for (int64_t j = 0; j < segments; ++j) {
      recvs[j].wait();
      if (s + 2 < p) sends.push_back(isend(segment(incoming, segments, j), next, group, tag(s + 1, j)));
    }
  }
  for (auto& w : sends) w.wait();
}

// Ring reduce-scatter along dim 0 of `x` (contiguous); returns this rank's reduced chunk in the
// accumulation dtype. Step s receives the partial sum of chunk (r - s - 2) from the previous
// rank, adds this rank's part segment by segment, and forwards each reduced segment at once.
// Chunk c starts at rank c + 1 and ends, complete, at rank c.
at::Tensor ring_reduce_scatter(const at::Tensor& x, const std::vector<int64_t>& sizes,
                               const Group& group) {
  const int64_t p = group.size(), r = group.rank();
  const auto off = offsets_of(sizes);
  const auto acc = accumulate_type(x.scalar_type());
  auto chunk = [&](int64_t c) { return x.narrow(0, off[c], sizes[c]); };
  if (p == 1) return chunk(0).to(acc, /*non_blocking=*/false, /*copy=*/true);
  const int64_t row_bytes = x.size(0) == 0 ? 0 : x.numel() / x.size(0) * at::elementSize(acc);
  const int64_t segments = segment_count(*std::max_element(sizes.begin(), sizes.end()) * row_bytes, p);
  const auto tags = reserve_tags(group);
  auto tag = [&](int64_t step, int64_t j) { return tags.step(step * segments + j); };
  const int64_t next = (r + 1) % p, prev = (r + p - 1) % p;
  // Same dtype: send straight from the input, no copy.
  const at::Tensor first = chunk((r - 1 + p) % p).to(acc).contiguous();
  std::vector<Work> sends;
  for (int64_t j = 0; j < segments; ++j) sends.push_back(isend(segment(first, segments, j), next, group, tag(0, j)));
  std::vector<at::Tensor> in_flight;  // buffers being sent, kept alive until the sends finish
  at::Tensor incoming;
  for (int64_t s = 0; s + 1 < p; ++s) {
    const int64_t c = (r - s - 2 + 2 * p) % p;
    incoming = at::empty(chunk(c).sizes(), x.options().dtype(acc));
    std::vector<Work> recvs;
    for (int64_t j = 0; j < segments; ++j) recvs.push_back(irecv(segment(incoming, segments, j), prev, group, tag(s, j)));
    const auto mine = chunk(c).contiguous();
    for (int64_t j = 0; j < segments; ++j) {
      recvs[j].wait();
      segment(incoming, segments, j).add_(segment(mine, segments, j));
      if (s + 2 < p) sends.push_back(isend(segment(incoming, segments, j), next, group, tag(s + 1, j)));
    }
    in_flight.push_back(incoming);
  }
  for (auto& w : sends) w.wait();
  return incoming;
}

std::vector<int64_t> split_sizes_or_chunks(const char* fn, c10::IntArrayRef sizes, int64_t extent,
                                           int64_t parts) {
  if (sizes.empty()) return chunk_sizes(extent, parts);
  TORCH_CHECK(static_cast<int64_t>(sizes.size()) == parts, "hyper_parallel::comm::", fn,
              ": expected one size per rank (", parts, "), got ", sizes.size());
  int64_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    TORCH_CHECK(sizes[i] >= 0, "hyper_parallel::comm::", fn, ": expected sizes[", i,
                "] >= 0, got ", sizes[i]);
    total += sizes[i];
  }
  TORCH_CHECK(total == extent, "hyper_parallel::comm::", fn, ": expected sizes summing to ",
              extent, ", got ", sizes, " (sum ", total, ")");
  return sizes.vec();
}

}  // namespace

const char* to_string(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "avg"; }

std::vector<int64_t> chunk_sizes(int64_t n, int64_t parts) {
  TORCH_CHECK(parts >= 1, "hyper_parallel::comm::chunk_sizes: expected parts >= 1, got ", parts);
  TORCH_CHECK(n >= 0, "hyper_parallel::comm::chunk_sizes: expected n >= 0, got ", n);
  const int64_t chunk = (n + parts - 1) / parts;
  std::vector<int64_t> sizes(parts);
  for (int64_t i = 0; i < parts; ++i) {
    sizes[i] = std::clamp<int64_t>(n - i * chunk, 0, chunk);
  }
  return sizes;
}

at::Tensor all_gather(const at::Tensor& input, int64_t dim, const Group& group,
                      c10::IntArrayRef sizes) {
  check_dtype("all_gather", input);
  dim = normalize_dim("all_gather", dim, input.dim());
  const int64_t p = group.size();
  std::vector<int64_t> rank_sizes = sizes.empty() ? std::vector<int64_t>(p, input.size(dim))
                                                  : sizes.vec();
  TORCH_CHECK(static_cast<int64_t>(rank_sizes.size()) == p,
              "hyper_parallel::comm::all_gather: expected one size per rank (", p, "), got ",
              rank_sizes.size());
  TORCH_CHECK(rank_sizes[group.rank()] == input.size(dim),
              "hyper_parallel::comm::all_gather: expected sizes[", group.rank(),
              "] to equal this rank's extent ", input.size(dim), ", got ", rank_sizes[group.rank()]);
  record_collective(CollectiveKind::kAllGather, describe(input, group));
  const auto off = offsets_of(rank_sizes);
  auto local = input.movedim(dim, 0);
  auto out_sizes = local.sizes().vec();
  out_sizes[0] = off.back();
  auto buffer = at::empty(out_sizes, input.options().memory_format(at::MemoryFormat::Contiguous));
  ring_all_gather(buffer, local.contiguous(), rank_sizes, group);
  return buffer.movedim(0, dim).contiguous();
}

at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim, ReduceOp op, const Group& group,
                          c10::IntArrayRef sizes) {
  check_dtype("reduce_scatter", input);
  dim = normalize_dim("reduce_scatter", dim, input.dim());
  const int64_t p = group.size();
  check_reduce_op("reduce_scatter", op, input);
  auto rank_sizes = split_sizes_or_chunks("reduce_scatter", sizes, input.size(dim), p);
  record_collective(CollectiveKind::kReduceScatter, describe(input, group));
  auto reduced = ring_reduce_scatter(input.movedim(dim, 0).contiguous(), rank_sizes, group);
  if (op == ReduceOp::kAvg) reduced.div_(p);
  return reduced.to(input.scalar_type()).movedim(0, dim).contiguous();
}

at::Tensor all_reduce(const at::Tensor& input, ReduceOp op, const Group& group) {
  check_dtype("all_reduce", input);
  check_reduce_op("all_reduce", op, input);
  const int64_t p = group.size();
  record_collective(CollectiveKind::kAllReduce, describe(input, group));
  auto flat = input.reshape({-1}).contiguous();
  auto sizes = chunk_sizes(flat.numel(), p);
  auto reduced = ring_reduce_scatter(flat, sizes, group);
  if (op == ReduceOp::kAvg) reduced.div_(p);
  auto buffer = at::empty({flat.numel()}, input.options());
  ring_all_gather(buffer, reduced.to(input.scalar_type()).contiguous(), sizes, group);
  return buffer.view(input.sizes());
}

at::Tensor all_to_all(const at::Tensor& input, int64_t split_dim, int64_t concat_dim,
                      const Group& group, c10::IntArrayRef split_sizes,
                      c10::IntArrayRef recv_concat_sizes) {
  check_dtype("all_to_all", input);
  split_dim = normalize_dim("all_to_all", split_dim, input.dim());
  concat_dim = normalize_dim("all_to_all", concat_dim, input.dim());
  const int64_t p = group.size(), r = group.rank();
  TORCH_CHECK(split_dim != concat_dim, "hyper_parallel::comm::all_to_all: expected split_dim != "
              "concat_dim, got both ", split_dim);
  TORCH_CHECK(p <= OpTags::kMaxSteps, "hyper_parallel::comm::all_to_all: expected a group of at most ",
              OpTags::kMaxSteps, " ranks, got ", p);
  auto splits = split_sizes_or_chunks("all_to_all", split_sizes, input.size(split_dim), p);
  std::vector<int64_t> recv_sizes = recv_concat_sizes.empty()
                                        ? std::vector<int64_t>(p, input.size(concat_dim))
                                        : recv_concat_sizes.vec();
  TORCH_CHECK(static_cast<int64_t>(recv_sizes.size()) == p,
              "hyper_parallel::comm::all_to_all: expected one receive size per rank (", p,
              "), got ", recv_sizes.size());
  TORCH_CHECK(recv_sizes[r] == input.size(concat_dim), "hyper_parallel::comm::all_to_all: expected "
              "recv_concat_sizes[", r, "] to equal this rank's extent ", input.size(concat_dim),
              ", got ", recv_sizes[r]);
  record_collective(CollectiveKind::kAllToAll, describe(input, group));
  const auto split_off = offsets_of(splits);
  std::vector<at::Tensor> received(p);
  auto piece_shape = input.sizes().vec();
  piece_shape[split_dim] = splits[r];
  for (int64_t j = 0; j < p; ++j) {
    auto shape = piece_shape;
    shape[concat_dim] = recv_sizes[j];
    received[j] = at::empty(shape, input.options());
  }
  received[r] = input.narrow(split_dim, split_off[r], splits[r]).contiguous();
  // Pairwise exchange: at step s send to r + s and receive from r - s, so every pair of ranks
  // exchanges exactly once and no rank waits on a rank that is busy elsewhere.
  const auto tags = reserve_tags(group);
  for (int64_t s = 1; s < p; ++s) {
    const int64_t dst = (r + s) % p, src = (r - s + p) % p;
    auto piece = input.narrow(split_dim, split_off[dst], splits[dst]).contiguous();
    auto send = isend(piece, dst, group, tags.step(s));
    auto recv = irecv(received[src], src, group, tags.step(s));
    recv.wait();
    send.wait();
  }
  return at::cat(received, concat_dim);
}

at::Tensor broadcast(const at::Tensor& input, int64_t src, const Group& group) {
  check_dtype("broadcast", input);
  const int64_t p = group.size(), r = group.rank();
  TORCH_CHECK(src >= 0 && src < p, "hyper_parallel::comm::broadcast: expected src in [0, ", p,
              "), got ", src);
  record_collective(CollectiveKind::kBroadcast, describe(input, group));
  auto buffer = input.contiguous().clone();
  const auto tags = reserve_tags(group);
  if (r == src) {
    std::vector<Work> sends;
    for (int64_t dst = 0; dst < p; ++dst) {
      if (dst != src) sends.push_back(isend(buffer, dst, group, tags.step(0)));
    }
    for (auto& w : sends) w.wait();
  } else {
    irecv(buffer, src, group, tags.step(0)).wait();
  }
  return buffer;
}

void barrier(const Group& group) {
  record_collective(CollectiveKind::kBarrier, group.name());
  if (group.size() == 1) return;
  // A token ring: step s's send leaves only after step s-1's receive, so after P-1 steps every
  // rank has (transitively) heard from every other, i.e. all have arrived.
  auto token = at::zeros({1}, at::kInt);
  auto received = at::empty({1}, at::kInt);
  const int64_t p = group.size(), r = group.rank();
  const auto tags = reserve_tags(group);
  for (int64_t s = 0; s + 1 < p; ++s) {
    auto send = isend(token, (r + 1) % p, group, tags.step(s));
    auto recv = irecv(received, (r + p - 1) % p, group, tags.step(s));
    recv.wait();
    send.wait();
  }
}

}  // namespace hyper_parallel::comm
