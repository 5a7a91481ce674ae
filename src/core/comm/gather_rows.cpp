#include <hyper_parallel/core/comm/gather_rows.h>

#include <sstream>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/chunks.h>
#include <hyper_parallel/core/comm/op.h>
#include <hyper_parallel/core/comm/p2p.h>

#include "control_channel.h"

namespace hyper_parallel::comm {

namespace {

constexpr const char* kName = "hyper_parallel::comm::gather_rows";
constexpr int64_t kCountStep = 0, kOffsetStep = 1, kRowStep = 2;
constexpr int64_t kBadIds = -1;  // a count that says: this rank's ids are out of range

void wait_all(std::vector<Work>& works) {
  for (auto& w : works) w.wait();
  works.clear();
}

// How many rows this rank asks of each owner; kBadIds for every owner if some id is out of range.
std::vector<int64_t> asked_of_each(const at::Tensor& ids, int64_t rows, int64_t p, bool& bad) {
  std::vector<int64_t> asked(p, 0);
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t chunk = (rows + p - 1) / std::max<int64_t>(p, 1);
  int64_t previous = -1;
  for (int64_t i = 0; i < ids.size(0); ++i) {
    if (id[i] < 0 || id[i] >= rows || id[i] <= previous) bad = true;
    if (bad) break;
    ++asked[id[i] / chunk];
    previous = id[i];
  }
  if (bad) asked.assign(p, kBadIds);
  return asked;
}

}  // namespace

at::Tensor gather_rows(const at::Tensor& shard, int64_t rows, const at::Tensor& ids, const Group& group,
                       int64_t content) {
  const int64_t p = group.size(), r = group.rank();
  TORCH_CHECK_TYPE(shard.defined() && at::isFloatingType(shard.scalar_type()), kName,
                   ": expected a floating-point shard, got ",
                   shard.defined() ? c10::toString(shard.scalar_type()) : "an undefined tensor");
  TORCH_CHECK_VALUE(rows >= 0 && shard.dim() == 2 && shard.size(0) == chunk_size(rows, p, r), kName,
                    ": expected a shard of [", chunk_size(std::max<int64_t>(rows, 0), p, r), ", cols] (rank ",
                    r, "'s torch.chunk piece of ", rows, " rows), got ", shard.sizes());
  TORCH_CHECK_TYPE(ids.defined() && ids.scalar_type() == at::kLong && ids.dim() == 1, kName,
                   ": expected 1-D int64 ids, got ",
                   ids.defined() ? c10::toString(ids.scalar_type()) : "undefined", " of ", ids.sizes());
  const int64_t cols = shard.size(1);
  std::ostringstream what;
  what << shard.scalar_type() << "[" << rows << ", " << cols << "] rows " << ids.size(0) << " of them, on "
       << group.name();
  OpSignature signature{
      CollectiveKind::kAllGather, shard.scalar_type(), {rows, cols, -1}, {"rows", "cols", "gather_rows"}};
  signature.content = content;
  OpScope scope(group, signature, what.str());
  const auto wanted = ids.contiguous();
  bool bad = false;
  const auto asked = asked_of_each(wanted, rows, p, bad);
  const auto tags = reserve_tags(group);
  // Round 1: the counts, both ways.
  auto counts_out = at::tensor(asked, at::kLong), counts_in = at::zeros({p}, at::kLong);
  std::vector<Work> works;
  for (int64_t q = 0; q < p; ++q) {
    if (q == r) continue;
    works.push_back(detail::post_express(false, counts_in.narrow(0, q, 1), q, group, tags.step(kCountStep)));
    works.push_back(detail::post_express(true, counts_out.narrow(0, q, 1), q, group, tags.step(kCountStep)));
  }
  wait_all(works);
  counts_in[r] = asked[r];
  const int64_t* in = counts_in.data_ptr<int64_t>();
  for (int64_t q = 0; q < p; ++q) {
    TORCH_CHECK_INDEX(in[q] != kBadIds, kName, ": expected every rank's ids ascending, unique and in [0, ",
                      rows, "), got ", q == r ? "this rank's" : "rank " + std::to_string(q) + "'s",
                      " outside that (", ids.size(0), " ids on this rank)");
  }
  // Round 2: the offsets of the rows asked of each owner, in its shard.
  std::vector<at::Tensor> offsets_in(p), rows_in(p), rows_out(p);
  int64_t first = 0;
  for (int64_t q = 0; q < p; ++q) {
    const auto mine = wanted.narrow(0, first, asked[q]) - chunk_offset(rows, p, q);
    first += asked[q];
    if (q == r) {
      offsets_in[r] = mine;
      continue;
    }
    offsets_in[q] = at::empty({in[q]}, at::kLong);
    works.push_back(detail::post_express(false, offsets_in[q], q, group, tags.step(kOffsetStep)));
    works.push_back(detail::post_express(true, mine.contiguous(), q, group, tags.step(kOffsetStep)));
    rows_in[q] = at::empty({asked[q], cols}, shard.options());
  }
  wait_all(works);
  // Round 3: the rows asked of this rank, to each asker; ours from each owner, in owner order.
  for (int64_t q = 0; q < p; ++q) {
    rows_out[q] = shard.index_select(0, offsets_in[q]);
    if (q == r) {
      rows_in[r] = rows_out[r];
      continue;
    }
    works.push_back(detail::post_express(false, rows_in[q], q, group, tags.step(kRowStep)));
    works.push_back(detail::post_express(true, rows_out[q], q, group, tags.step(kRowStep)));
  }
  wait_all(works);
  return at::cat(rows_in, 0);
}

}  // namespace hyper_parallel::comm
