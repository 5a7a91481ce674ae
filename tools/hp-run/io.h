#pragma once
// hp-run's own output. Everything goes through write(2) rather than stdio, so the launcher's
// messages and the ranks' lines never sit in different user-space buffers and come out in the
// wrong order.

#include <string>
#include <string_view>

namespace hp_run {

/// Writes all of `data` to `fd`, retrying on EINTR; gives up silently if the fd is gone (there is
/// nowhere left to report to).
void write_all(int fd, std::string_view data);
/// "hp-run: <message>" on stderr.
void log_message(const std::string& message);
std::string errno_text(int error);
/// "SIGSEGV (11)".
std::string describe_signal(int sig);
/// If hp-run was started with stdin/stdout/stderr closed, pipe() could hand out fd 0-2 and
/// dup2() in a rank would silently misroute its output: open /dev/null on them.
void ensure_standard_fds_open();

}  // namespace hp_run
