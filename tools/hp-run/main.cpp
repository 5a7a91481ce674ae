// hp-run: a small launcher for hyper_parallel programs, in the spirit of torchrun but without any
// dependency on libtorch (flags are parsed by CLI11, header-only).
//
//   hp-run --nproc-per-node N [--nnodes M] [--node-rank R] [--master-addr A]
//          [--master-port P] [--timeout S] [--grace S] -- program args...
//
// It starts N local ranks, each in its own process group with the usual RANK / WORLD_SIZE /
// MASTER_* environment, prefixes every line the ranks print with "[rank N] ", and tears the
// whole job down as soon as one rank fails, the timeout expires or the launcher itself is
// interrupted; with --max-restarts it then starts every rank again, and a stop request (SIGTERM,
// SIGINT) becomes a checkpoint at the ranks' next step boundary (SIGUSR1) and exit status 75. The rooms:
// options (the command line), ports, signals, output (prefixing), diagnosis (the rank the others waited on),
// rank_process (starting a rank) and launcher (the poll loop of one attempt).

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <exception>
#include <optional>
#include <string>

#include "io.h"
#include "launcher.h"
#include "options.h"
#include "ports.h"
#include "signals.h"

namespace {

constexpr int kUsageExitCode = 2;
constexpr int kRuntimeErrorExitCode = 1;

// Sleeps `seconds` unless hp-run is asked to stop meanwhile; returns that signal, or 0.
int backoff(hp_run::SignalPipe& signals, int seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  for (;;) {
    const auto left =
        std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return 0;
    pollfd fd{signals.read_fd(), POLLIN, 0};
    if (::poll(&fd, 1, static_cast<int>(left.count())) > 0) {
      for (const int sig : signals.take_pending()) {
        if (sig == SIGINT || sig == SIGTERM) return sig;
      }
    }
  }
}

// What an attempt's end means for the job: an exit status, or nullopt to restart.
std::optional<int> after_attempt(const hp_run::Options& opts, const hp_run::AttemptResult& result,
                                 int attempt) {
  using Stop = hp_run::AttemptResult::Stop;
  if (result.stop == Stop::kPreempted) {
    const auto step = result.checkpoint_step;
    hp_run::log_message(step && *step >= 0
                            ? "preempted; checkpoint at step " + std::to_string(*step)
                            : std::string("preempted; the ranks stopped without a checkpoint"));
    return result.exit_code;
  }
  if (result.stop != Stop::kRankFailed || attempt >= opts.max_restarts) return result.exit_code;
  hp_run::log_message("restart " + std::to_string(attempt + 1) + "/" + std::to_string(opts.max_restarts) +
                      " after " + result.failure);
  return std::nullopt;
}

// An attempt whose port this node cannot hold: it fails before any rank starts. The job's exit
// status, or nullopt to go on with the next attempt (and its port) at once.
std::optional<int> attempt_without_port(const hp_run::Options& opts, int base_port, const std::string& why,
                                        int attempt) {
  const std::string failure = attempt == 0 ? why
                                           : "attempt " + std::to_string(attempt) + " (--master-port " +
                                                 std::to_string(base_port) + " + " + std::to_string(attempt) +
                                                 "): " + why;
  if (attempt >= opts.max_restarts) {
    hp_run::log_message(failure + "; pick another --master-port");
    return kRuntimeErrorExitCode;
  }
  hp_run::log_message("restart " + std::to_string(attempt + 1) + "/" + std::to_string(opts.max_restarts) +
                      " after " + failure);
  return std::nullopt;
}

// Runs attempts until one succeeds, is stopped, or the restarts are spent. Attempt k rendezvouses
// on the base port + k (a fresh free port on a single node that picked one).
int run_job(hp_run::Options opts, bool pick_port) {
  using hp_run::Launcher;
  hp_run::SignalPipe signals;
  std::optional<Launcher::Clock::time_point> deadline;
  if (opts.timeout_s > 0) deadline = Launcher::Clock::now() + std::chrono::seconds(opts.timeout_s);
  const int base_port = opts.master_port;
  for (int attempt = 0;; ++attempt) {
    // The port stays held until the attempt ends (ports.h), on the node of rank 0's store. One
    // that cannot be held fails the attempt, as rank 0's store failing to listen there would.
    std::optional<hp_run::PortReservation> reserved;
    opts.master_port = pick_port ? 0 : base_port + attempt;
    try {
      if (opts.node_rank == 0) reserved.emplace(opts.master_port);
    } catch (const hp_run::PortUnavailable& e) {
      if (const auto status = attempt_without_port(opts, base_port, e.what(), attempt)) return *status;
      continue;
    }
    if (reserved) opts.master_port = reserved->port();
    const std::string count = std::to_string(attempt);
    Launcher launcher(opts, signals, deadline,
                      {{"TORCHELASTIC_RESTART_COUNT", count}, {"HP_RESTART_COUNT", count}});
    const auto status = after_attempt(opts, launcher.run(), attempt);
    if (status) return *status;
    if (const int sig = backoff(signals, opts.restart_backoff_s)) {
      hp_run::log_message("received " + hp_run::describe_signal(sig) + " before the restart; stopping");
      return 128 + sig;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace hp_run;
  Options opts;
  try {
    opts = parse_args(argc, argv);
  } catch (const HelpRequested& help) {
    write_all(STDOUT_FILENO, help.text);
    return 0;
  } catch (const UsageError& e) {
    log_message(e.what());
    write_all(STDERR_FILENO, "Try 'hp-run --help' for more information.\n");
    return kUsageExitCode;
  }
  try {
    ensure_standard_fds_open();
    return run_job(opts, /*pick_port=*/opts.master_port == 0);
  } catch (const std::exception& e) {
    log_message(e.what());
    return kRuntimeErrorExitCode;
  }
}
