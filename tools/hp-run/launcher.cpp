#include "launcher.h"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <string>
#include <stdexcept>

#include "io.h"

namespace hp_run {
namespace {

constexpr int kTimeoutExitCode = 124;  // same convention as timeout(1)

// After the last rank has exited, its output is already sitting in the pipe (a rank cannot exit
// while blocked on a full pipe), so a short drain period is enough. It only matters when a rank
// left a background process behind that still holds the pipe open; do not wait for that forever.
constexpr std::chrono::milliseconds kDrainAfterExit{1000};

}  // namespace

Launcher::Launcher(const Options& opts, SignalPipe& signals, std::optional<Clock::time_point> deadline,
                   Env extra_env)
    : opts_(opts), signals_(signals), extra_env_(std::move(extra_env)), timeout_deadline_(deadline) {}

Launcher::~Launcher() { kill_and_reap_leftovers(); }

AttemptResult Launcher::run() {
  spawn_all();
  event_loop();
  using Stop = AttemptResult::Stop;
  if (result_.stop == Stop::kRankFailed) log_message(result_.failure);
  if (result_.stop == Stop::kRankFailed || result_.stop == Stop::kTimeout || result_.stop == Stop::kSignal) {
    std::vector<RankReport> reports;
    for (const Rank& rank : ranks_) reports.push_back(rank.report);
    report_waited_on(reports);
  }
  return result_;
}

void Launcher::spawn_all() {
  ranks_.resize(static_cast<std::size_t>(opts_.nproc_per_node));
  for (int local = 0; local < opts_.nproc_per_node; ++local) {
    Rank& rank = ranks_[static_cast<std::size_t>(local)];
    rank.local_rank = local;
    rank.report.global_rank = opts_.node_rank * opts_.nproc_per_node + local;
    rank.prefix = "[rank " + std::to_string(rank.report.global_rank) + "] ";
    spawn(opts_, rank, extra_env_);
    ++running_;
  }
}

void Launcher::event_loop() {
  while (!done(Clock::now())) {
    poll_once();
    check_deadlines(Clock::now());
  }
  // Anything still open belongs to a background process a rank left behind. When the attempt
  // is being torn down, that process goes too.
  if (result_.stop != AttemptResult::Stop::kNone && result_.stop != AttemptResult::Stop::kPreempted) {
    kill_all(SIGKILL);
  }
  close_remaining_streams();
}

void Launcher::poll_once() {
  std::vector<pollfd> fds{pollfd{signals_.read_fd(), POLLIN, 0}};
  std::vector<std::pair<Rank*, OutputStream*>> owners;
  for (Rank& rank : ranks_) {
    for (OutputStream& stream : rank.streams) {
      if (stream.fd < 0) continue;
      fds.push_back(pollfd{stream.fd, POLLIN, 0});
      owners.emplace_back(&rank, &stream);
    }
  }
  const int ready = ::poll(fds.data(), fds.size(), poll_timeout_ms(Clock::now()));
  if (ready < 0 && errno != EINTR) throw std::runtime_error("poll: " + errno_text(errno));
  if (ready <= 0) return;
  if (fds[0].revents != 0) handle_signals();
  for (std::size_t i = 1; i < fds.size(); ++i) {
    if (fds[i].revents == 0) continue;
    Rank& rank = *owners[i - 1].first;
    read_stream(rank.prefix, *owners[i - 1].second, [&](std::string_view line) { observe(rank, line); });
  }
}

void Launcher::close_remaining_streams() {
  for (Rank& rank : ranks_) {
    for (OutputStream& stream : rank.streams) {
      if (stream.fd >= 0) {
        close_stream(rank.prefix, stream, [&](std::string_view line) { observe(rank, line); });
      }
    }
  }
}

bool Launcher::done(Clock::time_point now) const {
  if (running_ > 0) return false;
  const bool output_open =
      std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.output_open(); });
  return !output_open || (drain_deadline_ && now >= *drain_deadline_);
}

// A rank's flight-recorder lines (for the diagnosis) and its report of a preemption checkpoint.
void Launcher::observe(Rank& rank, std::string_view line) {
  rank.report.observe_line(line);
  constexpr std::string_view kTag = "hp-preempted: checkpoint at step ";
  if (const auto at = line.find(kTag); at != std::string_view::npos) {
    result_.checkpoint_step = std::strtoll(std::string(line.substr(at + kTag.size())).c_str(), nullptr, 10);
  } else if (line.find("hp-preempted: no checkpoint") != std::string_view::npos) {
    result_.checkpoint_step = -1;
  }
}

int Launcher::poll_timeout_ms(Clock::time_point now) const {
  std::optional<Clock::time_point> next;
  for (const auto& deadline : {timeout_deadline_, kill_deadline_, drain_deadline_, preempt_deadline_}) {
    if (deadline && (!next || *deadline < *next)) next = deadline;
  }
  if (!next) return -1;
  if (*next <= now) return 0;
  // Round up so the loop does not wake a millisecond early and spin.
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(*next - now).count();
  return static_cast<int>(std::min<long long>(ms, 60'000));
}

void Launcher::handle_signals() {
  for (const int sig : signals_.take_pending()) {
    if (sig == SIGINT || sig == SIGTERM) on_launcher_signal(sig);
  }
  reap_children();  // cheap, and SIGCHLDs may have coalesced
}

void Launcher::on_launcher_signal(int sig) {
  if (result_.stop == AttemptResult::Stop::kNone) {
    begin_preemption(sig);
  } else {
    // Already shutting down and the user insists: don't wait for the grace.
    log_message("received " + describe_signal(sig) + " again; killing all ranks now");
    kill_all(SIGKILL);
    kill_deadline_.reset();
  }
}

void Launcher::reap_children() {
  int status = 0;
  pid_t pid;
  while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
    const auto it =
        std::find_if(ranks_.begin(), ranks_.end(), [pid](const Rank& rank) { return rank.pid == pid; });
    if (it != ranks_.end() && it->running) on_rank_exit(*it, status);
  }
}

// Asks every rank to stop at its next step boundary (SIGUSR1): a preemption-aware program
// checkpoints and exits 0. The grace bounds the wait; SIGTERM, then SIGKILL, follow it.
void Launcher::begin_preemption(int sig) {
  log_message("received " + describe_signal(sig) + "; asking every rank to checkpoint and stop (SIGUSR1), " +
              std::to_string(opts_.preempt_grace_s) + " s before SIGTERM");
  result_.stop = AttemptResult::Stop::kPreempted;
  result_.signal = sig;
  result_.exit_code = kPreemptedExitCode;
  kill_all(SIGUSR1);
  preempt_deadline_ = Clock::now() + std::chrono::seconds(opts_.preempt_grace_s);
}

void Launcher::on_rank_exit(Rank& rank, int status) {
  rank.running = false;
  --running_;
  // Failures after shutdown began are mostly hp-run's own SIGTERM; only the first, spontaneous
  // failure explains what went wrong.
  if (is_failure(status) && result_.stop == AttemptResult::Stop::kNone) {
    result_.failure = describe_exit(rank.report.global_rank, status);
    begin_shutdown(AttemptResult::Stop::kRankFailed, exit_code_for(status));
  } else if (is_failure(status) && result_.stop == AttemptResult::Stop::kPreempted) {
    // Not a clean stop: the others need not wait for a checkpoint that cannot be complete.
    log_message(describe_exit(rank.report.global_rank, status) + " while stopping; terminating all ranks");
    preempt_deadline_.reset();
    begin_shutdown(AttemptResult::Stop::kSignal, 128 + result_.signal);
  }
  if (running_ == 0) {
    timeout_deadline_.reset();
    preempt_deadline_.reset();
    drain_deadline_ = Clock::now() + kDrainAfterExit;
  }
}

void Launcher::begin_shutdown(AttemptResult::Stop reason, int exit_code) {
  result_.stop = reason;
  result_.exit_code = exit_code;
  timeout_deadline_.reset();
  if (running_ == 0) return;
  kill_all(SIGTERM);
  kill_deadline_ = Clock::now() + std::chrono::seconds(opts_.grace_s);
}

void Launcher::check_deadlines(Clock::time_point now) {
  if (timeout_deadline_ && now >= *timeout_deadline_) {
    log_message("timeout after " + std::to_string(opts_.timeout_s) + " s; killing all ranks");
    begin_shutdown(AttemptResult::Stop::kTimeout, kTimeoutExitCode);
  }
  if (preempt_deadline_ && now >= *preempt_deadline_) {
    preempt_deadline_.reset();
    log_message("ranks still running " + std::to_string(opts_.preempt_grace_s) +
                " s after SIGUSR1; terminating all ranks");
    begin_shutdown(AttemptResult::Stop::kSignal, 128 + result_.signal);
  }
  if (kill_deadline_ && now >= *kill_deadline_) kill_after_grace();
}

void Launcher::kill_after_grace() {
  kill_deadline_.reset();
  std::string names;
  for (Rank& rank : ranks_) {
    if (!rank.running) continue;
    names += (names.empty() ? "" : ", ") + std::to_string(rank.report.global_rank);
    rank.report.unresponsive = true;
  }
  if (!names.empty()) {
    log_message("rank(s) " + names + " still running " + std::to_string(opts_.grace_s) +
                " s after SIGTERM; sending SIGKILL");
  }
  kill_all(SIGKILL);
}

// Signals the process group of every rank that is still running. For SIGKILL, also groups whose
// leader is gone but whose pipes are still held open: that can only be a leftover child of the
// rank. (The group id cannot be reused while any member of the group is alive.)
void Launcher::kill_all(int sig) {
  for (const Rank& rank : ranks_) {
    if (rank.running || (sig == SIGKILL && rank.output_open())) ::killpg(rank.pid, sig);
  }
}

// Only reached with running ranks if something threw (e.g. fork failed half-way through
// spawning): don't leave orphans behind.
void Launcher::kill_and_reap_leftovers() {
  for (Rank& rank : ranks_) {
    if (!rank.running) continue;
    ::killpg(rank.pid, SIGKILL);
    ::waitpid(rank.pid, nullptr, 0);
    rank.running = false;
  }
  for (Rank& rank : ranks_) {
    for (OutputStream& stream : rank.streams) {
      if (stream.fd >= 0) ::close(stream.fd);
    }
  }
}

}  // namespace hp_run
