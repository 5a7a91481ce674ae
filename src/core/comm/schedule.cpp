#include <hyper_parallel/core/comm/schedule.h>

#include <algorithm>
#include <numeric>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/chunks.h>
#include <hyper_parallel/core/comm/p2p.h>

#include "flight_recorder.h"

namespace hyper_parallel::comm {

at::ScalarType accumulate_type(at::ScalarType dtype) {
  return (dtype == at::kBFloat16 || dtype == at::kHalf) ? at::kFloat : dtype;
}

BlockLayout::BlockLayout(std::vector<int64_t> block_rows, int64_t chunks)
    : block_rows_(std::move(block_rows)) {
  const int64_t blocks = static_cast<int64_t>(block_rows_.size());
  TORCH_CHECK(blocks >= 1, "BlockLayout: expected at least one block, got none");
  TORCH_CHECK(chunks >= 1, "BlockLayout: expected chunks >= 1, got ", chunks);
  TORCH_CHECK(blocks <= OpTags::kMaxSteps, "BlockLayout: expected at most ", OpTags::kMaxSteps,
              " blocks (ranks), got ", blocks);
  chunks_ = std::min<int64_t>(chunks, OpTags::kMaxSteps / blocks);
  block_offset_.assign(blocks + 1, 0);
  for (int64_t b = 0; b < blocks; ++b) {
    TORCH_CHECK(block_rows_[b] >= 0, "BlockLayout: expected block_rows[", b, "] >= 0, got ", block_rows_[b]);
    block_offset_[b + 1] = block_offset_[b] + block_rows_[b];
  }
}

int64_t BlockLayout::chunk_rows(int64_t block, int64_t chunk) const {
  return chunk_size(block_rows_[block], chunks_, chunk);
}

int64_t BlockLayout::chunk_offset_in_block(int64_t block, int64_t chunk) const {
  return chunk_offset(block_rows_[block], chunks_, chunk);
}

at::Tensor BlockLayout::block(const at::Tensor& buffer, int64_t block) const {
  return buffer.narrow(0, block_offset_[block], block_rows_[block]);
}

at::Tensor BlockLayout::chunk(const at::Tensor& buffer, int64_t block, int64_t chunk) const {
  return buffer.narrow(0, block_offset_[block] + chunk_offset_in_block(block, chunk),
                       chunk_rows(block, chunk));
}

at::Tensor BlockLayout::chunk_of_block(const at::Tensor& block_rows, int64_t block, int64_t chunk) const {
  return block_rows.narrow(0, chunk_offset_in_block(block, chunk), chunk_rows(block, chunk));
}

namespace {

// The tags of one operation, one per (step, chunk) transfer.
struct StepChunkTags {
  OpTags tags;
  int64_t chunks;
  StepChunkTags(const Group& group, int64_t chunks) : tags(reserve_tags(group)), chunks(chunks) {}
  int tag(int64_t step, int64_t chunk) const { return tags.step(step * chunks + chunk); }
};

// A ring schedule's neighbours of this rank, and its tags.
struct Ring {
  int64_t p, r, next, prev;
  StepChunkTags tags;
  Ring(const Group& group, int64_t chunks)
      : p(group.size()), r(group.rank()), next((r + 1) % p), prev((r + p - 1) % p), tags(group, chunks) {}
  int tag(int64_t step, int64_t chunk) const { return tags.tag(step, chunk); }
};

void check_layout(const char* fn, const BlockLayout& layout, const Group& group) {
  TORCH_CHECK(layout.blocks() == group.size(), fn, ": expected one block per rank of ", group.name(), " (",
              group.size(), "), got ", layout.blocks());
}

}  // namespace

void ring_all_gather(const at::Tensor& own, const at::Tensor& gathered, const BlockLayout& layout,
                     const Group& group, const GatheredChunkFn& on_chunk, const InFlightFn& while_in_flight) {
  check_layout("ring_all_gather", layout, group);
  const int64_t p = group.size(), r = group.rank(), chunks = layout.chunks();
  TORCH_CHECK(gathered.is_contiguous() && gathered.size(0) == layout.total_rows(),
              "ring_all_gather: expected a contiguous buffer of ", layout.total_rows(), " rows, got ",
              gathered.sizes());
  TORCH_CHECK(own.is_contiguous() && own.size(0) == layout.block_rows(r),
              "ring_all_gather: expected this rank's block of ", layout.block_rows(r),
              " contiguous rows, got ", own.sizes());
  auto own_slot = layout.block(gathered, r);
  auto copy_own = [&] {
    if (own.data_ptr() != own_slot.data_ptr()) own_slot.copy_(own.view(own_slot.sizes()));
  };
  auto call = [&](int64_t block, int64_t j) {
    if (on_chunk) on_chunk(block, j, layout.chunk(gathered, block, j));
  };
  if (p == 1) {
    copy_own();
    for (int64_t j = 0; j < chunks; ++j) call(0, j);
    if (while_in_flight) while_in_flight();
    return;
  }
  const Ring ring(group, chunks);
  std::vector<Work> sends, recvs;  // recvs[(s - 1) * chunks + j]: chunk j of step s
  for (int64_t j = 0; j < chunks; ++j) {
    sends.push_back(isend(layout.chunk_of_block(own, r, j), ring.next, group, ring.tag(0, j)));
  }
  for (int64_t s = 1; s < p; ++s) {
    const int64_t block = (r - s + p) % p;
    for (int64_t j = 0; j < chunks; ++j) {
      recvs.push_back(irecv(layout.chunk(gathered, block, j), ring.prev, group, ring.tag(s - 1, j)));
    }
  }
  copy_own();
  // Step s: block r - s has arrived (step 0: it is this rank's own); forward it, then call back.
  for (int64_t s = 0; s < p; ++s) {
    const int64_t block = (r - s + p) % p;
    for (int64_t j = 0; j < chunks; ++j) {
      if (s == p - 1 && j == 0 && while_in_flight) while_in_flight();
      if (s > 0) {
        detail::FlightRecorder::set_chunk(s, j);
        recvs[(s - 1) * chunks + j].wait();
      }
      if (s > 0 && s + 1 < p) {
        sends.push_back(isend(layout.chunk(gathered, block, j), ring.next, group, ring.tag(s, j)));
      }
      call(block, j);
    }
  }
  for (auto& w : sends) w.wait();
}

at::Tensor ring_reduce_scatter(const BlockLayout& layout, int64_t width, const at::TensorOptions& input,
                               const Group& group, const ReduceChunkFn& reduce,
                               const InFlightFn& while_in_flight) {
  check_layout("ring_reduce_scatter", layout, group);
  const int64_t p = group.size(), r = group.rank(), chunks = layout.chunks();
  const auto acc = input.dtype(accumulate_type(c10::typeMetaToScalarType(input.dtype())));
  auto store = [&](const at::Tensor& result_chunk, const at::Tensor& sum) {
    TORCH_INTERNAL_ASSERT(sum.defined() && sum.sizes() == result_chunk.sizes(),
                          "ring_reduce_scatter: the callback returned ", sum.sizes(), " for a chunk of ",
                          result_chunk.sizes());
    if (!sum.is_same(result_chunk)) result_chunk.copy_(sum);
  };
  if (p == 1) {
    auto result = at::empty({layout.block_rows(0), width}, acc);
    for (int64_t j = 0; j < chunks; ++j) {
      store(layout.chunk_of_block(result, 0, j), reduce(0, j, [] { return at::Tensor(); }));
    }
    if (while_in_flight) while_in_flight();
    return result;
  }
  const Ring ring(group, chunks);
  bool ran_in_flight = !while_in_flight;
  // incoming[s - 1]: the partial sums of block r - s - 1 arriving at step s; the last one, block
  // r, is the result. All receives are posted up front.
  std::vector<at::Tensor> incoming;
  std::vector<Work> recvs;  // recvs[(s - 1) * chunks + j]
  for (int64_t s = 1; s < p; ++s) {
    const int64_t block = (r - s - 1 + 2 * p) % p;
    incoming.push_back(at::empty({layout.block_rows(block), width}, acc));
    for (int64_t j = 0; j < chunks; ++j) {
      recvs.push_back(
          irecv(layout.chunk_of_block(incoming.back(), block, j), ring.prev, group, ring.tag(s - 1, j)));
    }
  }
  std::vector<Work> sends;
  std::vector<at::Tensor> outgoing;  // kept alive until their sends complete
  for (int64_t s = 0; s < p; ++s) {
    const int64_t block = (r - s - 1 + 2 * p) % p;
    for (int64_t j = 0; j < chunks; ++j) {
      auto arrived = [&]() -> at::Tensor {
        if (s == 0) return at::Tensor();
        if (!ran_in_flight) {  // step 0's sums are on the wire: the independent work goes first
          ran_in_flight = true;
          while_in_flight();
        }
        detail::FlightRecorder::set_chunk(s, j);
        recvs[(s - 1) * chunks + j].wait();
        return layout.chunk_of_block(incoming[s - 1], block, j);
      };
      at::Tensor sum = reduce(block, j, arrived);
      if (s + 1 < p) {
        TORCH_INTERNAL_ASSERT(sum.defined() && sum.is_contiguous() && sum.scalar_type() == acc.dtype(),
                              "ring_reduce_scatter: the callback must return a contiguous partial sum "
                              "in the accumulate dtype");
        sends.push_back(isend(sum, ring.next, group, ring.tag(s, j)));
        outgoing.push_back(sum);
      } else {
        store(layout.chunk_of_block(incoming.back(), block, j), sum);
      }
    }
  }
  if (!ran_in_flight) while_in_flight();  // a callback that never asked for its partial sums
  for (auto& w : sends) w.wait();
  return incoming.back();
}

bool reduces_directly(at::ScalarType dtype) { return dtype == at::kBFloat16 || dtype == at::kHalf; }

at::Tensor direct_reduce_scatter(const BlockLayout& layout, int64_t width, const at::TensorOptions& input,
                                 const Group& group, const PartialChunkFn& partial,
                                 const InFlightFn& while_in_flight) {
  check_layout("direct_reduce_scatter", layout, group);
  const int64_t p = group.size(), r = group.rank(), chunks = layout.chunks();
  const auto wire = c10::typeMetaToScalarType(input.dtype());
  const auto acc = input.dtype(accumulate_type(wire));
  auto result = at::empty({layout.block_rows(r), width}, acc);
  auto own_partial = [&](int64_t j) {
    auto part = partial(r, j);
    TORCH_INTERNAL_ASSERT(
        part.defined() && part.sizes() == c10::IntArrayRef({layout.chunk_rows(r, j), width}),
        "direct_reduce_scatter: the callback returned ", part.sizes(), " for a chunk of [",
        layout.chunk_rows(r, j), ", ", width, "]");
    return part;
  };
  if (p == 1) {
    for (int64_t j = 0; j < chunks; ++j) layout.chunk_of_block(result, r, j).copy_(own_partial(j));
    if (while_in_flight) while_in_flight();
    return result;
  }
  const StepChunkTags tags(group, chunks);
  // received[(s * chunks) + j]: chunk j of this rank's block from rank r - 1 - s, posted up front.
  std::vector<at::Tensor> received;
  std::vector<Work> recvs;
  for (int64_t s = 0; s + 1 < p; ++s) {
    const int64_t src = (r - 1 - s + p) % p;
    for (int64_t j = 0; j < chunks; ++j) {
      received.push_back(at::empty({layout.chunk_rows(r, j), width}, input.dtype(wire)));
      recvs.push_back(irecv(received.back(), src, group, tags.tag(s, j)));
    }
  }
  // Step s: this rank's partial of block r + 1 + s, each chunk sent as soon as it is computed.
  std::vector<Work> sends;
  std::vector<at::Tensor> outgoing;  // kept alive until their sends complete
  for (int64_t s = 0; s + 1 < p; ++s) {
    const int64_t dst = (r + 1 + s) % p;
    for (int64_t j = 0; j < chunks; ++j) {
      auto part = partial(dst, j);
      TORCH_INTERNAL_ASSERT(
          part.defined() && part.sizes() == c10::IntArrayRef({layout.chunk_rows(dst, j), width}),
          "direct_reduce_scatter: the callback returned ", part.sizes());
      part = part.to(wire).contiguous();
      sends.push_back(isend(part, dst, group, tags.tag(s, j)));
      outgoing.push_back(std::move(part));
    }
  }
  // The independent work and then this rank's own partials, computed while the partials travel
  // (the independent work first: the longer of the two, it starts as soon as the link is busy);
  // then the sum over ranks in rank order 0 .. P - 1.
  if (while_in_flight) while_in_flight();
  std::vector<at::Tensor> own_partials;
  for (int64_t j = 0; j < chunks; ++j) own_partials.push_back(own_partial(j));
  for (int64_t j = 0; j < chunks; ++j) {
    const auto& own = own_partials[static_cast<size_t>(j)];
    auto sum = layout.chunk_of_block(result, r, j);
    for (int64_t q = 0; q < p; ++q) {
      at::Tensor term;
      if (q == r) {
        term = own;
      } else {
        const int64_t s = (r - 1 - q + p) % p;  // the step at which rank q sent to this rank
        detail::FlightRecorder::set_chunk(s, j);
        recvs[s * chunks + j].wait();
        term = received[s * chunks + j];
      }
      if (q == 0) {
        sum.copy_(term);
      } else {
        sum.add_(term);
      }
    }
  }
  for (auto& w : sends) w.wait();
  return result;
}

}  // namespace hyper_parallel::comm
