#pragma once
// Internal: the flight recorder. Each rank keeps its last kCapacity ops (kind, call number,
// group, shapes, state) so that, when something goes wrong, it can say what it was doing and
// whom it was waiting for:
//   - on a transfer failure or timeout, the op's error names the op, the group, the peer, the
//     chunk and the local shapes, and the rank prints its recent ops to stderr;
//   - on SIGTERM (hp-run stopping the job because another rank failed) it prints them too;
//   - either way it prints one line hp-run reads:
//       hp-waiting-on: rank R peer P op NAME seq S group G      (waiting inside a collective)
//       hp-waiting-on: rank R none                               (not inside a collective)
//     with global ranks, so hp-run can name the rank the others were waiting on.

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace hyper_parallel::comm::detail {

struct OpRecord {
  enum class State { kAgreeing, kRunning, kWaiting, kDone, kFailed };
  int64_t id = 0;
  std::string kind;   // e.g. "all_gather_matmul"
  int64_t seq = 0;    // call number on its group
  std::string group;  // e.g. "world"
  std::string shape;  // e.g. "BFloat16 m=512 k=1024 n=1408 chunks=2"
  State state = State::kAgreeing;
  int64_t peer = -1;    // global rank waited for, while kWaiting
  std::string waiting;  // what is awaited, e.g. "receive of chunk 1 of step 0"
  int64_t start_us = 0, end_us = 0;
};

class FlightRecorder {
 public:
  static constexpr size_t kCapacity = 64;
  static FlightRecorder& get();

  /// Starts recording an op on the calling thread; it is the thread's current op until end().
  std::shared_ptr<OpRecord> begin(std::string kind, int64_t seq, std::string group, std::string shape);
  void end(const std::shared_ptr<OpRecord>& record, bool ok);
  /// The calling thread's current op (nullptr outside one), and setting it back after a nested
  /// op ends.
  static std::shared_ptr<OpRecord> current();
  static void set_current(std::shared_ptr<OpRecord> record);
  /// The current op has agreed and runs.
  void set_running();

  /// Marks the current op as waiting for global rank `peer` (what: e.g. "receive of chunk 1").
  void set_waiting(int64_t peer, std::string what);
  void clear_waiting();
  /// Label the next wait with the engine's step and chunk.
  static void set_chunk(int64_t step, int64_t chunk);
  static std::string chunk_label();

  /// The recent ops, oldest first, one per line.
  std::string dump() const;
  /// The hp-waiting-on line of this rank (global rank `rank`).
  std::string waiting_on_line(int64_t rank) const;
  /// Prints dump() and the hp-waiting-on line to stderr (a failure or a stop request).
  void report(int64_t rank, const std::string& reason) const;

 private:
  mutable std::mutex mutex_;
  std::vector<std::shared_ptr<OpRecord>> records_;  // ring buffer
  size_t next_ = 0;
  int64_t next_id_ = 0;
  FlightRecorder();
};

/// Installs the SIGTERM report (when SIGTERM still has its default action): on SIGTERM the rank
/// reports, then dies of SIGTERM as it would have; and a terminate handler that reports before
/// the process terminates (the transport's threads terminate it when a peer vanishes while
/// nothing waits). `rank` is the global rank.
void install_stop_report(int64_t rank);

/// While it lives, a terminate by a connection reset reports that this rank was joining the store
/// at `where`: torch's store client aborts the process from its own thread when the listener it
/// joined resets it, which is what another program listening on the rendezvous port does.
class JoiningStoreNote {
 public:
  explicit JoiningStoreNote(std::string where);
  ~JoiningStoreNote();
  JoiningStoreNote(const JoiningStoreNote&) = delete;
  JoiningStoreNote& operator=(const JoiningStoreNote&) = delete;
};

}  // namespace hyper_parallel::comm::detail
