#include <hyper_parallel/core/tensor_parallel/mc2/ops.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/counters.h>
#include <hyper_parallel/core/comm/op.h>
#include <hyper_parallel/core/comm/trace.h>
#include <hyper_parallel/core/comm/schedule.h>
#include <hyper_parallel/core/nn/matmul.h>

#include "chunk_planner.h"
#include "transfers_only.h"

namespace hyper_parallel::tensor_parallel {

namespace detail {

at::Tensor local_matmul(const at::Tensor& a, const at::Tensor& b) {
  comm::trace::Span span("matmul");
  return nn::mm(a, b);
}

}  // namespace detail

void MC2Options::check_chunks_per_rank(const char* fn, int64_t chunks) {
  TORCH_CHECK_VALUE(chunks >= 1 || chunks == kAutoChunks, fn,
                    ": expected chunks_per_rank >= 1, or kAutoChunks (0: chosen per op), got ", chunks);
}

namespace {

using comm::CollectiveKind;
using detail::local_matmul;

void matmul_into(at::Tensor out, const at::Tensor& a, const at::Tensor& b) {
  comm::trace::Span span("matmul");
  nn::mm_out(out, a, b);
}

void check_operands(const char* fn, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.defined() && b.defined(), fn, ": expected defined tensors, got an undefined one");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, fn, ": expected 2-d operands, got ", a.sizes(), " and ",
              b.sizes());
  TORCH_CHECK(a.size(1) == b.size(0), fn, ": expected a [m, k] and b [k, n] with equal k, got ", a.sizes(),
              " and ", b.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), fn, ": expected operands of one dtype, got ",
              a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(at::isFloatingType(a.scalar_type()), fn, ": expected a floating dtype, got ", a.scalar_type());
}

// The chunk count the ranks agreed on, checked after the agreement: a bad count on one rank is
// the agreement error on every rank, and the same bad count on all is this error on all.
int64_t agreed_chunks(const comm::OpScope& op) {
  MC2Options::check_chunks_per_rank("MC2Options", op.chunks());
  TORCH_INTERNAL_ASSERT(op.chunks() >= 1, "the agreement settled on kAutoChunks, not a count");
  return op.chunks();
}

// Each of the P blocks holds `rows_per_rank` rows, cut into the chunk count the ranks agreed on.
comm::BlockLayout fused_layout(int64_t rows_per_rank, const comm::Group& group, int64_t chunks) {
  return comm::BlockLayout(std::vector<int64_t>(group.size(), rows_per_rank), chunks);
}

// G = all_gather(a) [P·m, k] through the ring; on_chunk(block, chunk, rows) sees each chunk as
// soon as it is here and forwarded.
at::Tensor gather_rows(
    const at::Tensor& a, const comm::Group& group, int64_t chunks,
    const std::function<void(const comm::BlockLayout&, int64_t, int64_t, const at::Tensor&)>& on_chunk,
    const comm::InFlightFn& while_in_flight = {}) {
  const auto layout = fused_layout(a.size(0), group, chunks);
  auto gathered = at::empty({layout.total_rows(), a.size(1)}, a.options());
  comm::ring_all_gather(
      a, gathered, layout, group,
      on_chunk ? [&](int64_t block, int64_t j, const at::Tensor& rows) { on_chunk(layout, block, j, rows); }
               : comm::GatheredChunkFn(),
      while_in_flight);
  return gathered;
}

// What the ranks must agree on: the extents that travel, the dtype and the chunk count (a
// fixed one, or with kAutoChunks this rank's proposal from the cost model: they settle on rank
// 0's). The gather moves a [m, k] (rows per rank); the reduce-scatter moves rows of the product
// a [M, k_l] b [k_l, n]. The extent that stays local (the gather's n, the reduce-scatter's k_l)
// may differ between ranks: a weight whose sharded dim does not divide by the world size has
// shards of torch.chunk sizes.
comm::OpSignature signature(CollectiveKind kind, const at::Tensor& a, const at::Tensor& b,
                            const comm::Group& group, const MC2Options& options) {
  comm::OpSignature sig{kind, a.scalar_type()};
  if (kind == kAllGatherMatmulKind) {
    sig.dims = {a.size(0), a.size(1), 0, 0};
    sig.names = {"m", "k"};
    sig.chunks = detail::all_gather_mm_chunks(a, b, group, options);
  } else {
    sig.dims = {a.size(0), b.size(1), 0, 0};
    sig.names = {"M", "n"};
    sig.chunks = detail::mm_reduce_scatter_chunks(a, b, group, options);
  }
  sig.chunks_proposed = options.chunks_per_rank() == MC2Options::kAutoChunks;
  return sig;
}

void check_reduce_rows(const char* fn, const at::Tensor& a, const comm::Group& group) {
  TORCH_CHECK(a.size(0) % group.size() == 0, fn, ": expected rows (", a.size(0),
              ") divisible by world_size (", group.size(), "), got remainder ", a.size(0) % group.size());
}

}  // namespace

std::pair<at::Tensor, at::Tensor> all_gather_mm(const at::Tensor& a_in, const at::Tensor& b,
                                                const comm::Group& group, const MC2Options& options,
                                                const comm::InFlightFn& while_in_flight) {
  check_operands("all_gather_matmul", a_in, b);
  const auto a = a_in.contiguous();
  comm::OpScope op(group, signature(kAllGatherMatmulKind, a, b, group, options), group.name());
  auto y = at::empty({group.size() * a.size(0), b.size(1)}, a.options());
  // The chunk's rows of Y are computed while the next chunks travel.
  auto gathered = gather_rows(
      a, group, agreed_chunks(op),
      [&](const comm::BlockLayout& layout, int64_t block, int64_t j, const at::Tensor& rows) {
        matmul_into(layout.chunk(y, block, j), rows, b);
      },
      while_in_flight);
  return {y, gathered};
}

at::Tensor mm_reduce_scatter(const at::Tensor& a_in, const at::Tensor& b, const comm::Group& group,
                             const MC2Options& options, const at::Tensor& addend,
                             const comm::InFlightFn& while_in_flight) {
  check_operands("matmul_reduce_scatter", a_in, b);
  check_reduce_rows("matmul_reduce_scatter", a_in, group);
  const auto a = a_in.contiguous();
  comm::OpScope op(group, signature(kMatmulReduceScatterKind, a, b, group, options), group.name());
  const int64_t n = b.size(1);
  TORCH_INTERNAL_ASSERT(!addend.defined() || addend.sizes() == c10::IntArrayRef({a.size(0), n}),
                        "matmul_reduce_scatter: addend of shape ", addend.sizes());
  const int64_t chunks = agreed_chunks(op);
  // One rank: nothing to overlap, one matmul.
  if (group.size() == 1) {
    auto y = addend.defined() ? local_matmul(a, b) + addend : local_matmul(a, b);
    if (while_in_flight) while_in_flight();
    return y;
  }
  const auto layout = fused_layout(a.size(0) / group.size(), group, chunks);
  const auto acc = comm::accumulate_type(a.scalar_type());
  at::Tensor reduced;
  if (comm::reduces_directly(a.scalar_type())) {
    // 16-bit: each partial product is computed and sent straight to the rank that owns its
    // block while the next one is computed; the owner sums in float32. An addend joins each
    // partial in float32 and the sum is rounded for the wire: at::add of two 16-bit tensors
    // adds in float32 and rounds to 16 bits, in one pass with no float32 copies (this rank's
    // own block never travels and keeps its float32 sum).
    reduced = comm::direct_reduce_scatter(
        layout, n, a.options(), group,
        [&](int64_t block, int64_t j) {
          auto part = local_matmul(layout.chunk(a, block, j), b);
          if (!addend.defined()) return part;
          const auto extra = layout.chunk(addend, block, j);
          if (block != group.rank() && extra.scalar_type() == part.scalar_type()) return at::add(part, extra);
          return part.to(acc).add_(extra);
        },
        while_in_flight);
  } else {
    // The partial product of a chunk is computed before its arrived partial sum is waited for,
    // so the matmul overlaps the transfer.
    reduced = comm::ring_reduce_scatter(
        layout, n, a.options(), group,
        [&](int64_t block, int64_t j, const std::function<at::Tensor()>& arrived) {
          auto part = local_matmul(layout.chunk(a, block, j), b);
          auto sum = arrived();
          if (sum.defined()) {
            sum.add_(part);
          } else {
            sum = part.to(acc);
          }
          if (addend.defined()) sum.add_(layout.chunk(addend, block, j));
          return sum;
        },
        while_in_flight);
  }
  return reduced.to(a.scalar_type());
}

std::pair<at::Tensor, at::Tensor> all_gather_matmul(const at::Tensor& x, const at::Tensor& w,
                                                    const comm::Group& group, const MC2Options& options) {
  TORCH_CHECK(w.dim() == 2, "all_gather_matmul: expected w [n, k], got ", w.sizes());
  return all_gather_mm(x, w.t(), group, options);
}

at::Tensor matmul_reduce_scatter(const at::Tensor& x, const at::Tensor& w, const comm::Group& group,
                                 const MC2Options& options) {
  TORCH_CHECK(w.dim() == 2, "matmul_reduce_scatter: expected w [n, k], got ", w.sizes());
  return mm_reduce_scatter(x, w.t(), group, options);
}

namespace detail {

void all_gather_matmul_transfers_only(const at::Tensor& x, const at::Tensor& w, const comm::Group& group,
                                      const MC2Options& options) {
  check_operands("all_gather_matmul", x, w.t());
  const auto a = x.contiguous(), b = w.t();
  comm::OpScope op(group, signature(kAllGatherMatmulKind, a, b, group, options), "transfers only",
                   /*counted=*/false);
  gather_rows(a, group, agreed_chunks(op), {});
}

void matmul_reduce_scatter_transfers_only(const at::Tensor& x, const at::Tensor& w, const comm::Group& group,
                                          const MC2Options& options) {
  check_operands("matmul_reduce_scatter", x, w.t());
  check_reduce_rows("matmul_reduce_scatter", x, group);
  const auto a = x.contiguous(), b = w.t();
  comm::OpScope op(group, signature(kMatmulReduceScatterKind, a, b, group, options), "transfers only",
                   /*counted=*/false);
  const int64_t n = w.size(0);
  const auto layout = fused_layout(x.size(0) / group.size(), group, agreed_chunks(op));
  if (comm::reduces_directly(x.scalar_type())) {
    comm::direct_reduce_scatter(layout, n, x.options(), group, [&](int64_t block, int64_t j) {
      return at::empty({layout.chunk_rows(block, j), n}, x.options());
    });
    return;
  }
  const auto acc = x.options().dtype(comm::accumulate_type(x.scalar_type()));
  comm::ring_reduce_scatter(layout, n, x.options(), group,
                            [&](int64_t block, int64_t j, const std::function<at::Tensor()>& arrived) {
                              auto sum = arrived();
                              return sum.defined() ? sum : at::empty({layout.chunk_rows(block, j), n}, acc);
                            });
}

}  // namespace detail

}  // namespace hyper_parallel::tensor_parallel
