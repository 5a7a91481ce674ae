#pragma once
// OpScope: one collective or fused op on the calling thread, from before its first transfer to
// after its last. Every collective of this library, and every fused op above it, opens one
// before it posts any payload. It
//   - makes the ranks agree: each rank sends a fixed-size signature (op, call number, dtype,
//     extents, chunk count) to every other rank of the group and checks theirs. Payload
//     buffers are posted only when all agree; otherwise every rank throws the same
//     DisagreementError (a c10::Error),
//     naming the op and each rank's shapes, and the group stays usable. (A transport told to
//     receive fewer bytes than arrive aborts the process on its own thread; agreeing first is
//     the only way to turn that into an error.) HP_COMM_CHECK=0 skips this, which is unsafe:
//     ranks that disagree then abort or hang instead of failing with a message;
//   - records the op in the flight recorder (what each rank was doing and waiting for, printed
//     on a failure or a stop request), counts it (counters.h) and traces it (trace.h).

#include <array>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/comm/trace.h>

namespace hyper_parallel::comm {

/// Thrown on every rank when the ranks' signatures of one op differ (no payload was sent): a
/// layer above can say what its op stands for. Python sees a RuntimeError.
class DisagreementError : public c10::Error {
 public:
  using c10::Error::Error;
};

/// An op's kind: the name under which the ranks agree on it, and it is counted (counters.h),
/// traced (trace.h) and recorded (the flight recorder). comm's collectives are the constants
/// below; a layer above names its own fused ops the same way (MC2's are in
/// tensor_parallel/mc2/ops.h: a fused op is one collective, not an all_gather plus a matmul),
/// so comm lists no op of another layer. Kinds are equal when their names are.
///
/// Usage:
///   inline constexpr comm::CollectiveKind kMyFusedOp{"my_fused_op"};
class CollectiveKind {
 public:
  /// The longest name: the ranks' signatures carry it in a fixed-size field.
  static constexpr size_t kMaxNameLength = 24;
  /// `name` is a string literal of 1 to kMaxNameLength characters; a constant with a longer or
  /// empty name does not compile, and a kind made at run time with one throws.
  explicit constexpr CollectiveKind(const char* name) : name_(name) {
    const size_t n = std::char_traits<char>::length(name);
    // Evaluated only when thrown, so never in a constant expression.
    if (n == 0 || n > kMaxNameLength)
      throw std::invalid_argument("CollectiveKind: expected a name of 1 to " +
                                  std::to_string(kMaxNameLength) + " characters, got '" + name + "' (" +
                                  std::to_string(n) + ")");
  }
  constexpr const char* name() const { return name_; }
  friend constexpr bool operator==(CollectiveKind a, CollectiveKind b) {
    return std::string_view(a.name_) == std::string_view(b.name_);
  }

  static const CollectiveKind kAllGather, kReduceScatter, kAllReduce, kAllToAll, kBroadcast, kBarrier;
  /// The link measurement of link_probe.h: a ring of timed messages, not counted.
  static const CollectiveKind kLinkProbe;

 private:
  const char* name_;
};
inline constexpr CollectiveKind CollectiveKind::kAllGather{"all_gather"};
inline constexpr CollectiveKind CollectiveKind::kReduceScatter{"reduce_scatter"};
inline constexpr CollectiveKind CollectiveKind::kAllReduce{"all_reduce"};
inline constexpr CollectiveKind CollectiveKind::kAllToAll{"all_to_all"};
inline constexpr CollectiveKind CollectiveKind::kBroadcast{"broadcast"};
inline constexpr CollectiveKind CollectiveKind::kBarrier{"barrier"};
inline constexpr CollectiveKind CollectiveKind::kLinkProbe{"link_probe"};

/// comm's own kinds.
inline constexpr std::array<CollectiveKind, 7> kCommCollectiveKinds = {
    CollectiveKind::kAllGather, CollectiveKind::kReduceScatter, CollectiveKind::kAllReduce,
    CollectiveKind::kAllToAll,  CollectiveKind::kBroadcast,     CollectiveKind::kBarrier,
    CollectiveKind::kLinkProbe};

/// "all_gather", "matmul_reduce_scatter", ...
inline const char* to_string(CollectiveKind kind) { return kind.name(); }

namespace detail {
struct OpRecord;
struct GroupImpl;
}  // namespace detail

/// What every rank of the group must agree on for one op: its kind, dtype, up to four extents
/// (op-specific) and the chunk count. An extent with a name is shown in messages by that name;
/// unnamed extents (nullptr) are compared all the same and shown as d<i> when non-zero.
struct OpSignature {
  CollectiveKind kind;
  at::ScalarType dtype = at::kFloat;
  std::array<int64_t, 4> dims{};
  std::array<const char*, 4> names{};
  int64_t chunks = 1;
  /// True: `chunks` is this rank's proposal (each rank's own estimate of the best count), and
  /// the ranks settle on rank 0's: OpScope::chunks(). Everything else must still be equal, and
  /// every rank must propose. The exchange then always happens, HP_COMM_CHECK=0 or not: it is
  /// what makes the ranks agree.
  bool chunks_proposed = false;
  /// What the op carries, named by the caller where equal sizes need not mean equal contents (a
  /// hash of a gradient bucket's parameters); 0: not named. Compared like the extents.
  int64_t content = 0;
};

/// Whether an op makes the ranks agree on its signature before it posts payload.
enum class Agreement {
  /// A round trip with every other rank of the group, before the first payload transfer.
  kPerOp,
  /// None per op: the caller has made the ranks agree beforehand on the shape and order of every
  /// such op (a gradient reducer's bucket layout), so starting one never waits for a peer.
  /// Checked after the fact: the signatures of these ops (content included) join a digest that
  /// the group's next per-op agreement compares, so ranks that started different ones, or the
  /// same ones in another order, get an error there (naming how many ops it covers).
  kAgreedInAdvance,
};

/// Usage (inside a collective):
///   OpScope op(group, {CollectiveKind::kAllGather, x.scalar_type(), {rows, cols}, {"rows", "cols"}},
///              "detail");
///   ... post transfers ...
/// Ops are issued on a group by one thread at a time: the op order and the agreement's control
/// tag are per group, so two threads issuing on one group would interleave their ops differently
/// on each rank. A second thread that starts an op while another thread's op on the same group is
/// being issued gets a c10::Error; a background thread uses a group of its own (new_group), as
/// the asynchronous checkpoint writer does.
class OpScope {
 public:
  /// Claims the group for the calling thread (throws if another thread is issuing an op on it),
  /// agrees with the group's other ranks (throws if they disagree), then records the op.
  /// `counted` false: not recorded in the collective counters (transfers-only benchmarks).
  OpScope(const Group& group, const OpSignature& signature, const std::string& detail, bool counted = true,
          Agreement agreement = Agreement::kPerOp);
  ~OpScope();
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

  /// For an op that goes on after the scope (a started all-reduce finishing on a library
  /// thread): the scope's end no longer ends the op's flight-recorder record; whoever finishes
  /// the op takes it (detail::FlightRecorder::set_current, then end).
  std::shared_ptr<detail::OpRecord> keep_record_open();

  /// The chunk count every rank of the group uses: the signature's, or rank 0's proposal.
  int64_t chunks() const { return chunks_; }

 private:
  void claim_group(const Group& group, const OpSignature& signature);
  void release_group();

  trace::OpSpan span_;
  std::shared_ptr<detail::OpRecord> record_, previous_;
  int uncaught_ = 0;
  int64_t chunks_ = 1;
  bool kept_open_ = false;
  detail::GroupImpl* claimed_ = nullptr;
  std::thread::id previous_thread_;
};

/// Whether ops agree on their signatures before posting payload (HP_COMM_CHECK, default on).
bool agreement_checks_enabled();

/// The flight recorder's recent ops of this rank, one per line (see OpScope).
std::string flight_recorder_dump();

}  // namespace hyper_parallel::comm
