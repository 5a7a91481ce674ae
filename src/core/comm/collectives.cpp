#include <hyper_parallel/core/comm/collectives.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>

#include <hyper_parallel/core/comm/counters.h>
#include <hyper_parallel/core/comm/op.h>
#include <hyper_parallel/core/comm/p2p.h>
#include <hyper_parallel/core/comm/schedule.h>

#include "group_impl.h"

namespace hyper_parallel::comm {
namespace {

// What a collective takes: a reduction, the dtypes it adds; one that only moves data (all_gather,
// all_to_all, broadcast), also the narrow integers and bool (a mask), which travel as bytes.
enum class Moves { kReduces, kDataOnly };

void check_dtype(const char* fn, const at::Tensor& t, Moves moves = Moves::kReduces) {
  TORCH_CHECK(t.defined(), "hyper_parallel::comm::", fn, ": expected a defined tensor, got undefined");
  TORCH_CHECK_VALUE(!t.is_meta(), "hyper_parallel::comm::", fn,
                    ": expected a tensor with data, got one on meta (materialize it first, e.g. to_empty)");
  switch (t.scalar_type()) {
    case at::kFloat:
    case at::kDouble:
    case at::kBFloat16:
    case at::kHalf:
    case at::kLong:
    case at::kInt:
      return;
    case at::kShort:
    case at::kChar:
    case at::kByte:
    case at::kBool:
      if (moves == Moves::kDataOnly) return;
      [[fallthrough]];
    default:
      TORCH_CHECK(false, "hyper_parallel::comm::", fn,
                  ": expected dtype float32, float64, bfloat16, float16, ",
                  moves == Moves::kDataOnly ? "int64, int32, int16, int8, uint8 or bool" : "int64 or int32",
                  ", got ", t.scalar_type());
  }
}

int64_t normalize_dim(const char* fn, int64_t dim, int64_t ndim) {
  TORCH_CHECK(ndim >= 1, "hyper_parallel::comm::", fn,
              ": expected a tensor with at least 1 dim, got a scalar");
  TORCH_CHECK(dim >= -ndim && dim < ndim, "hyper_parallel::comm::", fn, ": expected dim in [", -ndim, ", ",
              ndim, "), got ", dim);
  return dim < 0 ? dim + ndim : dim;
}

void check_reduce_op(const char* fn, ReduceOp op, const at::Tensor& t) {
  TORCH_CHECK(op != ReduceOp::kAvg || at::isFloatingType(t.scalar_type()), "hyper_parallel::comm::", fn,
              ": ReduceOp avg does not support integer dtype ", t.scalar_type(), "; use sum and divide");
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

// The flat collectives cut each rank's block into chunks of at least kChunkBytes, at most
// kMaxChunks of them, so a rank forwards (all-gather) or reduces and forwards (reduce-scatter)
// the first chunks of a block while the last ones are still arriving. With two ranks nothing is
// forwarded, so an all-gather sends each block whole.
constexpr int64_t kChunkBytes = int64_t{1} << 20;
constexpr int64_t kMaxChunks = 8;

int64_t chunks_for(int64_t max_block_bytes) {
  return std::clamp<int64_t>(max_block_bytes / kChunkBytes, 1, kMaxChunks);
}

// Rows of the flat collectives are single elements: block b holds sizes[b] * row_elems of them.
BlockLayout flat_layout(const std::vector<int64_t>& sizes, int64_t row_elems, int64_t chunks) {
  std::vector<int64_t> elems;
  elems.reserve(sizes.size());
  for (auto s : sizes) elems.push_back(s * row_elems);
  return BlockLayout(std::move(elems), chunks);
}

// Reduce-scatter of the flat, contiguous `x` whose blocks hold sizes[b] * row_elems elements;
// returns this rank's block in the accumulate dtype. 16-bit inputs take the direct schedule (each
// rank's elements travel once, in 16 bits, to their owner, which sums in float32); others the
// ring, where each rank adds its own elements to the partial sum that arrives, chunk by chunk,
// and forwards it at once.
at::Tensor flat_reduce_scatter(const at::Tensor& x, const std::vector<int64_t>& sizes, int64_t row_elems,
                               const Group& group) {
  const auto dtype = x.scalar_type();
  const bool direct = reduces_directly(dtype);
  const auto acc = accumulate_type(dtype);
  const int64_t max_rows = *std::max_element(sizes.begin(), sizes.end());
  const int64_t wire_bytes = at::elementSize(direct ? dtype : acc);
  const auto layout = flat_layout(sizes, row_elems, chunks_for(max_rows * row_elems * wire_bytes));
  const auto flat = x.view({-1, 1});
  if (direct) {
    return direct_reduce_scatter(
               layout, 1, x.options(), group,
               [&](int64_t block, int64_t chunk) { return layout.chunk(flat, block, chunk); })
        .view({-1});
  }
  return ring_reduce_scatter(layout, 1, x.options(), group,
                             [&](int64_t block, int64_t chunk, const std::function<at::Tensor()>& arrived) {
                               auto mine = layout.chunk(flat, block, chunk);
                               auto sum = arrived();
                               if (!sum.defined())
                                 return mine.to(acc).contiguous();  // no copy if already acc
                               return sum.add_(mine);
                             })
      .view({-1});
}

// A signature field for a list of sizes every rank must agree on.
int64_t hash_of(c10::IntArrayRef sizes) {
  uint64_t h = 1469598103934665603ull;
  for (auto v : sizes) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
  return static_cast<int64_t>(h >> 1);
}

int64_t elements_per_slice(const at::Tensor& t, int64_t dim) {
  int64_t n = 1;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (d != dim) n *= t.size(d);
  }
  return n;
}

std::vector<int64_t> split_sizes_or_chunks(const char* fn, c10::IntArrayRef sizes, int64_t extent,
                                           int64_t parts) {
  if (sizes.empty()) return chunk_sizes(extent, parts);
  TORCH_CHECK(static_cast<int64_t>(sizes.size()) == parts, "hyper_parallel::comm::", fn,
              ": expected one size per rank (", parts, "), got ", sizes.size());
  int64_t total = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    TORCH_CHECK(sizes[i] >= 0, "hyper_parallel::comm::", fn, ": expected sizes[", i, "] >= 0, got ",
                sizes[i]);
    total += sizes[i];
  }
  TORCH_CHECK(total == extent, "hyper_parallel::comm::", fn, ": expected sizes summing to ", extent, ", got ",
              sizes, " (sum ", total, ")");
  return sizes.vec();
}

}  // namespace

const char* to_string(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "avg"; }

at::Tensor all_gather(const at::Tensor& input, int64_t dim, const Group& group, c10::IntArrayRef sizes,
                      const InFlightFn& while_in_flight) {
  check_dtype("all_gather", input, Moves::kDataOnly);
  dim = normalize_dim("all_gather", dim, input.dim());
  const int64_t p = group.size();
  std::vector<int64_t> rank_sizes = sizes.empty() ? std::vector<int64_t>(p, input.size(dim)) : sizes.vec();
  TORCH_CHECK(static_cast<int64_t>(rank_sizes.size()) == p,
              "hyper_parallel::comm::all_gather: expected one size per rank (", p, "), got ",
              rank_sizes.size());
  TORCH_CHECK(rank_sizes[group.rank()] == input.size(dim),
              "hyper_parallel::comm::all_gather: expected sizes[", group.rank(),
              "] to equal this rank's extent ", input.size(dim), ", got ", rank_sizes[group.rank()]);
  OpScope op(group,
             {CollectiveKind::kAllGather,
              input.scalar_type(),
              {std::accumulate(rank_sizes.begin(), rank_sizes.end(), int64_t{0}),
               elements_per_slice(input, dim), hash_of(rank_sizes), dim},
              {"gathered_extent", "slice_elements", "sizes_hash", "dim"}},
             describe(input, group));
  // Each rank's block travels in its own memory order (nothing is transposed before the send);
  // the blocks are concatenated along dim afterwards, in one copy, and in none when nothing
  // precedes dim (the blocks are then already in the output's order).
  const int64_t row_elems = elements_per_slice(input, dim);
  const int64_t total_rows = std::accumulate(rank_sizes.begin(), rank_sizes.end(), int64_t{0});
  const int64_t max_rows = *std::max_element(rank_sizes.begin(), rank_sizes.end());
  const auto layout = flat_layout(rank_sizes, row_elems,
                                  p == 2 ? 1 : chunks_for(max_rows * row_elems * input.element_size()));
  auto buffer = at::empty({total_rows * row_elems, 1}, input.options());
  ring_all_gather(input.contiguous().view({-1, 1}), buffer, layout, group, {}, while_in_flight);
  auto out_sizes = input.sizes().vec();
  out_sizes[dim] = total_rows;
  const auto outer = c10::multiply_integers(input.sizes().begin(), input.sizes().begin() + dim);
  if (outer == 1) return buffer.view(out_sizes);
  std::vector<at::Tensor> blocks;
  for (int64_t q = 0; q < p; ++q) {
    auto block_sizes = input.sizes().vec();
    block_sizes[dim] = rank_sizes[q];
    blocks.push_back(layout.block(buffer, q).view(block_sizes));
  }
  return at::cat(blocks, dim);
}

at::Tensor reduce_scatter(const at::Tensor& input, int64_t dim, ReduceOp op, const Group& group,
                          c10::IntArrayRef sizes) {
  check_dtype("reduce_scatter", input);
  dim = normalize_dim("reduce_scatter", dim, input.dim());
  const int64_t p = group.size();
  check_reduce_op("reduce_scatter", op, input);
  auto rank_sizes = split_sizes_or_chunks("reduce_scatter", sizes, input.size(dim), p);
  OpScope scope(group,
                {CollectiveKind::kReduceScatter,
                 input.scalar_type(),
                 {input.size(dim), elements_per_slice(input, dim), hash_of(rank_sizes),
                  dim * 2 + static_cast<int64_t>(op == ReduceOp::kAvg)},
                 {"extent", "slice_elements", "sizes_hash", "dim_and_op"}},
                describe(input, group));
  auto rows = input.movedim(dim, 0).contiguous();
  const int64_t row_elems = rows.size(0) == 0 ? 0 : rows.numel() / rows.size(0);
  auto reduced = flat_reduce_scatter(rows, rank_sizes, row_elems, group);
  if (op == ReduceOp::kAvg) reduced.div_(p);
  auto shape = rows.sizes().vec();
  shape[0] = rank_sizes[group.rank()];
  auto result = reduced.view(shape).movedim(0, dim);
  if (result.scalar_type() == input.scalar_type() && result.is_contiguous()) return result;
  // One pass rounds the accumulate dtype's sum and moves dim back.
  return at::empty(result.sizes(), input.options().memory_format(at::MemoryFormat::Contiguous)).copy_(result);
}

at::Tensor all_reduce(const at::Tensor& input, ReduceOp op, const Group& group, int64_t content) {
  check_dtype("all_reduce", input);
  check_reduce_op("all_reduce", op, input);
  const int64_t p = group.size();
  OpSignature signature{CollectiveKind::kAllReduce,
                        input.scalar_type(),
                        {input.numel(), static_cast<int64_t>(op == ReduceOp::kAvg)},
                        {"numel", "avg"}};
  signature.content = content;
  OpScope scope(group, signature, describe(input, group));
  auto flat = input.reshape({-1}).contiguous();
  auto sizes = chunk_sizes(flat.numel(), p);
  auto reduced = flat_reduce_scatter(flat, sizes, 1, group);
  if (op == ReduceOp::kAvg) reduced.div_(p);
  auto buffer = at::empty({flat.numel()}, input.options());
  const int64_t max_elems = *std::max_element(sizes.begin(), sizes.end());
  const auto layout = flat_layout(sizes, 1, p == 2 ? 1 : chunks_for(max_elems * input.element_size()));
  ring_all_gather(reduced.to(input.scalar_type()).contiguous().view({-1, 1}), buffer.view({-1, 1}), layout,
                  group);
  return buffer.view(input.sizes());
}

at::Tensor all_to_all(const at::Tensor& input, int64_t split_dim, int64_t concat_dim, const Group& group,
                      c10::IntArrayRef split_sizes, c10::IntArrayRef recv_concat_sizes) {
  check_dtype("all_to_all", input, Moves::kDataOnly);
  split_dim = normalize_dim("all_to_all", split_dim, input.dim());
  concat_dim = normalize_dim("all_to_all", concat_dim, input.dim());
  const int64_t p = group.size(), r = group.rank();
  TORCH_CHECK(split_dim != concat_dim,
              "hyper_parallel::comm::all_to_all: expected split_dim != "
              "concat_dim, got both ",
              split_dim);
  TORCH_CHECK(p <= OpTags::kMaxSteps, "hyper_parallel::comm::all_to_all: expected a group of at most ",
              OpTags::kMaxSteps, " ranks, got ", p);
  auto splits = split_sizes_or_chunks("all_to_all", split_sizes, input.size(split_dim), p);
  std::vector<int64_t> recv_sizes =
      recv_concat_sizes.empty() ? std::vector<int64_t>(p, input.size(concat_dim)) : recv_concat_sizes.vec();
  TORCH_CHECK(static_cast<int64_t>(recv_sizes.size()) == p,
              "hyper_parallel::comm::all_to_all: expected one receive size per rank (", p, "), got ",
              recv_sizes.size());
  TORCH_CHECK(recv_sizes[r] == input.size(concat_dim),
              "hyper_parallel::comm::all_to_all: expected "
              "recv_concat_sizes[",
              r, "] to equal this rank's extent ", input.size(concat_dim), ", got ", recv_sizes[r]);
  OpScope op(group,
             {CollectiveKind::kAllToAll,
              input.scalar_type(),
              {input.size(split_dim),
               elements_per_slice(input, concat_dim) / std::max<int64_t>(input.size(split_dim), 1),
               split_dim * 64 + concat_dim, hash_of(splits) ^ hash_of(recv_sizes)},
              {"split_extent", "slice_elements", "dims", "sizes_hash"}},
             describe(input, group));
  const auto split_off = offsets_of(splits);
  std::vector<at::Tensor> received(p);
  auto piece_shape = input.sizes().vec();
  piece_shape[split_dim] = splits[r];
  for (int64_t j = 0; j < p; ++j) {
    auto shape = piece_shape;
    shape[concat_dim] = recv_sizes[j];
    received[j] = at::empty(shape, input.options());
  }
  received[r] = input.narrow(split_dim, split_off[r], splits[r]);  // read once, by the cat
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
  return at::cat(received, concat_dim).contiguous();  // one rank's cat keeps its piece's strides
}

at::Tensor broadcast(const at::Tensor& input, int64_t src, const Group& group) {
  check_dtype("broadcast", input, Moves::kDataOnly);
  const int64_t p = group.size(), r = group.rank();
  TORCH_CHECK(src >= 0 && src < p, "hyper_parallel::comm::broadcast: expected src in [0, ", p, "), got ",
              src);
  OpScope op(group, {CollectiveKind::kBroadcast, input.scalar_type(), {input.numel(), src}, {"numel", "src"}},
             describe(input, group));
  const auto tags = reserve_tags(group);
  if (r == src) {
    // Sent from the input in place; the caller gets its own copy, made while the sends travel.
    const auto data = input.contiguous();
    std::vector<Work> sends;
    for (int64_t dst = 0; dst < p; ++dst) {
      if (dst != src) sends.push_back(isend(data, dst, group, tags.step(0)));
    }
    auto result = data.is_same(input) ? input.clone() : data;
    for (auto& w : sends) w.wait();
    return result;
  }
  auto buffer = at::empty(input.sizes(), input.options().memory_format(at::MemoryFormat::Contiguous));
  irecv(buffer, src, group, tags.step(0)).wait();
  return buffer;
}

void barrier(const Group& group) {
  OpScope op(group, {CollectiveKind::kBarrier, at::kInt, {}}, group.name());
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

std::vector<std::string> all_gather_strings(const std::string& value, const Group& group) {
  // Bytes travel in int32 words: the collectives move no uint8.
  const int64_t p = group.size();
  auto lengths =
      all_gather(at::full({1}, static_cast<int64_t>(value.size()), at::kLong), 0, group).contiguous();
  const auto* length = lengths.data_ptr<int64_t>();
  std::vector<int64_t> words(static_cast<size_t>(p));
  for (int64_t r = 0; r < p; ++r) words[r] = std::max<int64_t>(1, (length[r] + 3) / 4);
  auto buffer = at::zeros({words[group.rank()]}, at::kInt);
  std::memcpy(buffer.data_ptr(), value.data(), value.size());
  auto all = all_gather(buffer, 0, group, words).contiguous();
  const auto* bytes = static_cast<const char*>(all.data_ptr());
  std::vector<std::string> out;
  int64_t word = 0;
  for (int64_t r = 0; r < p; ++r) {
    out.emplace_back(bytes + 4 * word, static_cast<size_t>(length[r]));
    word += words[r];
  }
  return out;
}

}  // namespace hyper_parallel::comm
