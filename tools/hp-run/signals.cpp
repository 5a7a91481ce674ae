#include "signals.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <stdexcept>

#include "io.h"

namespace hp_run {
namespace {

// The one piece of global state: the handler cannot reach anything else.
volatile sig_atomic_t g_signal_pipe_write_fd = -1;

extern "C" void record_signal(int sig) {
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  // If the pipe is full, earlier bytes are still pending and the loop will wake up anyway;
  // SIGCHLDs coalesce and are handled by a waitpid() loop.
  [[maybe_unused]] const ssize_t written = ::write(g_signal_pipe_write_fd, &byte, 1);
  errno = saved_errno;
}

}  // namespace

SignalPipe::SignalPipe() {
  if (::pipe2(fds_, O_CLOEXEC | O_NONBLOCK) != 0) throw std::runtime_error("pipe: " + errno_text(errno));
  g_signal_pipe_write_fd = fds_[1];
  struct sigaction action {};
  action.sa_handler = record_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  for (const int sig : kHandledSignals) ::sigaction(sig, &action, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
}

SignalPipe::~SignalPipe() {
  for (const int sig : kHandledSignals) ::signal(sig, SIG_DFL);
  g_signal_pipe_write_fd = -1;
  ::close(fds_[0]);
  ::close(fds_[1]);
}

std::vector<int> SignalPipe::take_pending() {
  std::vector<int> signals;
  unsigned char buffer[64];
  ssize_t n;
  while ((n = ::read(fds_[0], buffer, sizeof buffer)) > 0) signals.insert(signals.end(), buffer, buffer + n);
  return signals;
}

ScopedSignalBlock::ScopedSignalBlock() {
  sigset_t blocked;
  sigemptyset(&blocked);
  for (const int sig : kHandledSignals) sigaddset(&blocked, sig);
  ::sigprocmask(SIG_BLOCK, &blocked, &previous_);
}

ScopedSignalBlock::~ScopedSignalBlock() { ::sigprocmask(SIG_SETMASK, &previous_, nullptr); }

}  // namespace hp_run
