#pragma once
// The launch loop of one attempt: start every local rank, copy their output, and tear the whole
// attempt down as soon as one rank fails, the timeout expires or hp-run itself is interrupted
// (SIGTERM to every rank's process group, SIGKILL after the grace). Single-threaded: one poll()
// loop watches every output pipe plus the signal self-pipe, so a chatty rank cannot deadlock it.

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "options.h"
#include "rank_process.h"
#include "signals.h"

namespace hp_run {

/// How an attempt ended.
struct AttemptResult {
  /// kPreempted: hp-run was asked to stop (SIGTERM, SIGINT) and asked the ranks to stop at a
  /// step boundary (SIGUSR1); kSignal: a second signal, or the ranks did not stop in time.
  enum class Stop { kNone, kRankFailed, kTimeout, kPreempted, kSignal };
  Stop stop = Stop::kNone;
  /// 0 if every rank succeeded; 75 (EX_TEMPFAIL) if every rank stopped cleanly for a
  /// preemption; the first failing rank's exit code (128 + signal if it was killed); 124 on
  /// timeout; 128 + signal if hp-run was interrupted.
  int exit_code = 0;
  /// "rank 1 exited with code 3", for kRankFailed.
  std::string failure;
  /// The signal that interrupted hp-run, for kPreempted and kSignal.
  int signal = 0;
  /// The step a rank checkpointed at when it stopped for a preemption ("hp-preempted:
  /// checkpoint at step N"); -1 if it stopped without one.
  std::optional<long long> checkpoint_step;
};

/// The exit status of an attempt every rank stopped cleanly for a preemption.
inline constexpr int kPreemptedExitCode = 75;

class Launcher {
 public:
  using Clock = std::chrono::steady_clock;
  using Env = std::vector<std::pair<std::string, std::string>>;

  /// `deadline`: when the timeout expires (nullopt: never). `extra_env` is added to every rank's
  /// environment.
  Launcher(const Options& opts, SignalPipe& signals, std::optional<Clock::time_point> deadline,
           Env extra_env);
  ~Launcher();
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  /// Runs the attempt to its end, reports a failure (and whom the ranks waited on) on stderr.
  AttemptResult run();

 private:
  void spawn_all();
  void event_loop();
  void poll_once();
  void close_remaining_streams();
  bool done(Clock::time_point now) const;
  int poll_timeout_ms(Clock::time_point now) const;
  void handle_signals();
  void on_launcher_signal(int sig);
  void reap_children();
  void on_rank_exit(Rank& rank, int status);
  void begin_shutdown(AttemptResult::Stop reason, int exit_code);
  void begin_preemption(int sig);
  void observe(Rank& rank, std::string_view line);
  void check_deadlines(Clock::time_point now);
  void kill_after_grace();
  void kill_all(int sig);
  void kill_and_reap_leftovers();

  const Options& opts_;
  SignalPipe& signals_;
  Env extra_env_;
  std::vector<Rank> ranks_;
  int running_ = 0;
  AttemptResult result_;
  std::optional<Clock::time_point> timeout_deadline_, kill_deadline_, drain_deadline_, preempt_deadline_;
};

}  // namespace hp_run
