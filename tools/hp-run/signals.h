#pragma once
// Signals, via the self-pipe trick: the handler only writes the signal number into a pipe, and
// the launcher's poll() loop picks it up like any other input. No work is done inside handlers.

#include <signal.h>

#include <vector>

namespace hp_run {

/// The signals hp-run handles: the user's or scheduler's stop requests, and its ranks' exits.
inline constexpr int kHandledSignals[] = {SIGINT, SIGTERM, SIGCHLD};

/// Installs the handlers for its lifetime (and ignores SIGPIPE: a closed stdout must not kill
/// the launcher before it has cleaned up).
class SignalPipe {
 public:
  SignalPipe();
  ~SignalPipe();
  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;

  int read_fd() const { return fds_[0]; }
  /// The signals received since the last call, in order.
  std::vector<int> take_pending();

 private:
  int fds_[2] = {-1, -1};
};

/// Blocks the handled signals for its lifetime. Used around fork() so that a signal arriving in
/// the child before exec cannot run the handler there and write into the (shared) self-pipe.
class ScopedSignalBlock {
 public:
  ScopedSignalBlock();
  ~ScopedSignalBlock();
  ScopedSignalBlock(const ScopedSignalBlock&) = delete;
  ScopedSignalBlock& operator=(const ScopedSignalBlock&) = delete;

  const sigset_t& previous() const { return previous_; }

 private:
  sigset_t previous_;
};

}  // namespace hp_run
