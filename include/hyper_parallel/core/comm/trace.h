#pragma once
// Tracing: with HP_TRACE=DIR every rank writes DIR/rank<R>.json, Chrome trace-event JSON that
// Perfetto (ui.perfetto.dev) and chrome://tracing open. It shows, per rank:
//   - on the calling ("compute") thread, one span per collective or fused op, and the spans
//     inside it (each chunk matmul of an MC2 op);
//   - one span per send and per receive, from the moment it is posted to the moment the
//     transport completes it. Completion is observed by a waiter thread that blocks on the
//     transfer itself, not by the compute thread's wait(): a span that ended only when the
//     compute thread got round to waiting would always overlap the matmul and prove nothing.
// Each event's args.op says which op it belongs to (the outermost op span active on the thread
// that posted it), so `hp-trace overlap DIR` can report, per op, the share of transfer time
// covered by matmul spans.
//
// Tracing costs a thread hop per transfer; it is off unless HP_TRACE is set.

#include <cstdint>
#include <string>

namespace hyper_parallel::comm::trace {

/// True when HP_TRACE named a directory at init_process_group.
bool enabled();

/// A span on the calling thread, from construction to destruction. No-op unless enabled().
///
/// Usage:
///   { trace::Span span("matmul"); at::mm_out(y, a, b); }
class Span {
 public:
  explicit Span(const char* name, const char* category = "compute");
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  int64_t start_us_ = -1;
  const char* name_;
  const char* category_;
  int64_t op_;
};

/// A span that groups what happens inside it as one op (when no op is active on the thread
/// already): transfers and spans posted meanwhile get its op id. The library opens one around
/// every collective and fused op; a program can open one around its own composite step (e.g.
/// an unfused all_gather followed by a matmul) to measure that step's overlap.
class OpSpan {
 public:
  explicit OpSpan(std::string name, std::string detail = {});
  ~OpSpan();
  OpSpan(const OpSpan&) = delete;
  OpSpan& operator=(const OpSpan&) = delete;
  /// The op id events inside carry (-1 when tracing is off).
  int64_t id() const { return id_; }

 private:
  int64_t id_ = -1;
  bool outermost_ = false;
  int64_t start_us_ = -1;
  std::string name_, detail_;
};

/// Writes this rank's events to DIR/rank<R>.json now (destroy_process_group does it too).
void flush();

namespace detail {
/// Called by init_process_group: reads HP_TRACE, remembers the rank.
void start(int64_t rank);
/// Microseconds on the clock all ranks of this machine share (CLOCK_MONOTONIC).
int64_t now_us();
/// The op id of the outermost OpSpan on the calling thread, or -1.
int64_t current_op();
/// Makes `op` the calling thread's current op while it lives (a library thread that finishes
/// an op started on another thread: its transfers are that op's in the trace).
class CurrentOpGuard {
 public:
  explicit CurrentOpGuard(int64_t op);
  ~CurrentOpGuard();
  CurrentOpGuard(const CurrentOpGuard&) = delete;
  CurrentOpGuard& operator=(const CurrentOpGuard&) = delete;

 private:
  int64_t previous_;
};
/// Records a finished transfer span from `post_us` to `end_us` on a waiter thread's track.
void record_transfer(const std::string& name, int64_t op, int64_t post_us, int64_t end_us, int64_t bytes,
                     int64_t lane);
}  // namespace detail

}  // namespace hyper_parallel::comm::trace
