#include <hyper_parallel/core/comm/op.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <sstream>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/counters.h>
#include <hyper_parallel/core/comm/p2p.h>
#include <hyper_parallel/core/comm/work.h>

#include "control_channel.h"
#include "flight_recorder.h"
#include "group_impl.h"
#include "test_hooks.h"

namespace hyper_parallel::comm {
namespace {

// The fixed-size signature every rank sends to every other rank of the group. The op's kind is
// its name, zero-padded, in kNameFields words.
constexpr int kNameFields = CollectiveKind::kMaxNameLength / sizeof(int64_t);
static_assert(CollectiveKind::kMaxNameLength % sizeof(int64_t) == 0);
enum Field {
  kMagic,
  kName,
  kSeq = kName + kNameFields,
  kDtype,
  kDim0,
  kDim1,
  kDim2,
  kDim3,
  kChunks,
  kProposed,
  kGroupSize,
  kContent,
  kUnagreedOps,  // the ops agreed in advance since the group's last per-op agreement
  kUnagreedFirstSeq,
  kUnagreedDigest,
  kFields
};
constexpr int64_t kSignatureMagic = 0x48504f5053;  // "HPOPS"

std::string describe(const std::array<int64_t, kFields>& f, const std::array<const char*, 4>& names) {
  std::array<char, CollectiveKind::kMaxNameLength + 1> kind{};
  std::memcpy(kind.data(), &f[kName], CollectiveKind::kMaxNameLength);
  std::ostringstream s;
  s << kind.data() << " " << c10::toString(static_cast<at::ScalarType>(f[kDtype]));
  for (int i = 0; i < 4; ++i) {
    if (names[i] != nullptr) {
      s << " " << names[i] << "=" << f[kDim0 + i];
    } else if (f[kDim0 + i] != 0) {
      s << " d" << i << "=" << f[kDim0 + i];
    }
  }
  s << " chunks=" << (f[kProposed] ? "auto:" : "") << f[kChunks];
  if (f[kContent] != 0) s << " content=" << std::hex << f[kContent] << std::dec;
  return s.str();
}

// The ops agreed in advance that an agreement's signature covers.
std::string describe_unagreed(const std::array<int64_t, kFields>& f) {
  if (f[kUnagreedOps] == 0) return "no op agreed in advance before it";
  std::ostringstream s;
  s << "before it " << f[kUnagreedOps] << " ops agreed in advance from call " << f[kUnagreedFirstSeq]
    << " (digest " << std::hex << f[kUnagreedDigest] << std::dec << ")";
  return s.str();
}

uint64_t mix(uint64_t h, int64_t v) {
  h ^= static_cast<uint64_t>(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  return h;
}

// An op agreed in advance joins the digest that the group's next per-op agreement compares.
void note_unagreed(detail::GroupImpl& g, const std::array<int64_t, kFields>& f) {
  if (g.unagreed_ops++ == 0) g.unagreed_first_seq = f[kSeq];
  for (int i = kName; i < kUnagreedOps; ++i) g.unagreed_digest = mix(g.unagreed_digest, f[i]);
}

std::array<int64_t, kFields> fields_of(const OpSignature& sig, int64_t seq, int64_t group_size) {
  std::array<int64_t, kFields> f{};
  f[kMagic] = kSignatureMagic;
  const std::string_view name = sig.kind.name();
  std::memcpy(&f[kName], name.data(), name.size());  // at most kMaxNameLength: CollectiveKind's rule
  f[kSeq] = seq;
  f[kDtype] = static_cast<int64_t>(sig.dtype);
  for (int i = 0; i < 4; ++i) f[kDim0 + i] = sig.dims[i];
  f[kChunks] = sig.chunks;
  f[kProposed] = sig.chunks_proposed ? 1 : 0;
  f[kGroupSize] = group_size;
  f[kContent] = sig.content;
  return f;
}

// Every rank sends its signature to every other rank and receives theirs; all ranks then hold
// the same P signatures and reach the same verdict. The messages have a fixed size and a tag of
// their own per group, matched in order, so they can never be mistaken for payload. Returns the
// chunk count all use: the common one, or rank 0's proposal.
int64_t agree(const Group& group, const OpSignature& sig, int64_t seq) {
  const int64_t p = group.size(), r = group.rank();
  auto& g = group.impl();
  auto mine = fields_of(sig, seq, p);
  mine[kUnagreedOps] = g.unagreed_ops;
  mine[kUnagreedFirstSeq] = g.unagreed_first_seq;
  mine[kUnagreedDigest] = static_cast<int64_t>(g.unagreed_digest);
  // Whatever the verdict, every rank's next agreement covers the ops from here on.
  g.unagreed_ops = 0;
  g.unagreed_first_seq = -1;
  g.unagreed_digest = 0;
  std::vector<at::Tensor> all(p);
  all[r] = at::tensor(std::vector<int64_t>(mine.begin(), mine.end()), at::kLong);
  std::vector<Work> recvs(p), sends;
  for (int64_t q = 0; q < p; ++q) {
    if (q == r) continue;
    all[q] = at::empty({kFields}, at::kLong);
    recvs[q] = detail::post_control(/*is_send=*/false, all[q], q, group);
  }
  for (int64_t q = 0; q < p; ++q) {
    if (q != r) sends.push_back(detail::post_control(/*is_send=*/true, all[r], q, group));
  }
  auto& recorder = detail::FlightRecorder::get();
  for (int64_t q = 0; q < p; ++q) {
    if (q == r) continue;
    recorder.set_waiting(group.global_ranks()[q], "its signature of this op");
    recvs[q].wait();
    recorder.clear_waiting();
  }
  for (auto& w : sends) w.wait();
  bool same = true, same_op = true;
  int64_t max_seq = seq;
  std::vector<std::array<int64_t, kFields>> fields(p);
  for (int64_t q = 0; q < p; ++q) {
    auto a = all[q].accessor<int64_t, 1>();
    for (int i = 0; i < kFields; ++i) fields[q][i] = a[i];
    TORCH_INTERNAL_ASSERT(fields[q][kMagic] == kSignatureMagic, "agreement: rank ", q, " of ", group.name(),
                          " sent a malformed signature");
    max_seq = std::max(max_seq, fields[q][kSeq]);
    auto theirs = fields[q];
    if (sig.chunks_proposed && theirs[kProposed] == 1) theirs[kChunks] = mine[kChunks];  // proposals differ
    same = same && theirs == mine;
    same_op = same_op && std::equal(theirs.begin(), theirs.begin() + kUnagreedOps, mine.begin());
  }
  if (same) return fields[0][kChunks];
  // Every rank throws the same error; the next op starts from one call number on every rank.
  g.next_seq = max_seq + 1;
  std::ostringstream ranks;
  for (int64_t q = 0; q < p; ++q) {
    ranks << (q ? "; " : "") << "rank " << q << " (global " << group.global_ranks()[q] << "): call "
          << fields[q][kSeq] << ", " << describe(fields[q], sig.names) << ", "
          << describe_unagreed(fields[q]);
  }
  if (!same_op) {
    throw DisagreementError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                            c10::str("hyper_parallel::comm: ranks of ", group.name(), " disagree on ",
                                     to_string(sig.kind), " (this rank's call ", seq, "): ", ranks.str(),
                                     ". No data was sent. Every rank must call the same collectives in the "
                                     "same order with matching shapes, dtypes and chunk counts"));
  }
  TORCH_CHECK(false, "hyper_parallel::comm: ranks of ", group.name(), " agree on ", to_string(sig.kind),
              " (this rank's call ", seq,
              ") but started different ops agreed in advance before it: ", ranks.str(),
              ". Those ops (gradient buckets and sums, started without a per-op agreement) differ in "
              "order, shape, content or chunk count between the ranks, so their results may have mixed "
              "different data; every rank must start them in the same order with the same contents "
              "(the same modules in each step)");
}

}  // namespace

bool agreement_checks_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("HP_COMM_CHECK");
    return v == nullptr || std::string(v) != "0";
  }();
  return enabled;
}

std::string flight_recorder_dump() { return detail::FlightRecorder::get().dump(); }

void OpScope::claim_group(const Group& group, const OpSignature& signature) {
  auto& issuing = group.impl().issuing_thread;
  std::thread::id expected;  // no thread
  const auto me = std::this_thread::get_id();
  if (!issuing.compare_exchange_strong(expected, me)) {
    TORCH_CHECK(expected == me, "OpScope: expected one thread at a time to issue ops on group ", group.name(),
                ", got a ", to_string(signature.kind), " from a second thread while another thread's op is ",
                "being issued; a background thread needs a group of its own (comm::new_group)");
  }
  previous_thread_ = expected;  // this thread when nested, else none
  claimed_ = &group.impl();
}

void OpScope::release_group() {
  if (claimed_ != nullptr) claimed_->issuing_thread.store(previous_thread_);
  claimed_ = nullptr;
}

OpScope::OpScope(const Group& group, const OpSignature& signature, const std::string& detail, bool counted,
                 Agreement agreement)
    : span_(to_string(signature.kind), detail),
      uncaught_(std::uncaught_exceptions()),
      chunks_(signature.chunks) {
  TORCH_INTERNAL_ASSERT(!signature.chunks_proposed || agreement == Agreement::kPerOp,
                        "OpScope: a proposed chunk count needs a per-op agreement");
  claim_group(group, signature);
  const int64_t seq = group.impl().next_seq.fetch_add(1);
  auto& recorder = detail::FlightRecorder::get();
  previous_ = detail::FlightRecorder::current();
  record_ = recorder.begin(to_string(signature.kind), seq, group.name(),
                           describe(fields_of(signature, seq, group.size()), signature.names));
  try {
    const bool checked = agreement_checks_enabled() || signature.chunks_proposed;
    if (agreement == Agreement::kPerOp && group.size() > 1 && checked && !test_hooks::transfers_skipped()) {
      chunks_ = agree(group, signature, seq);
    } else if (agreement == Agreement::kAgreedInAdvance && group.size() > 1) {
      note_unagreed(group.impl(), fields_of(signature, seq, group.size()));
    }
  } catch (...) {
    recorder.end(record_, /*ok=*/false);
    detail::FlightRecorder::set_current(previous_);
    record_.reset();
    release_group();
    throw;
  }
  recorder.set_running();
  if (counted) record_collective(signature.kind, detail);
}

std::shared_ptr<detail::OpRecord> OpScope::keep_record_open() {
  kept_open_ = true;
  return record_;
}

OpScope::~OpScope() {
  release_group();
  if (!record_) return;
  // A kept record is ended by whoever finishes the op, unless the op fails before handing it on.
  const bool ok = std::uncaught_exceptions() == uncaught_;
  if (!kept_open_ || !ok) detail::FlightRecorder::get().end(record_, ok);
  detail::FlightRecorder::set_current(previous_);
}

}  // namespace hyper_parallel::comm
