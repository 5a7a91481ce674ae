#pragma once
// The ranks' output: each rank's stdout and stderr are pipes that hp-run reads and copies to its
// own, every line prefixed with "[rank R] " and written in one write(), so lines of different
// ranks never interleave mid-line.

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

namespace hp_run {

/// A rank that prints an enormous line without a newline must not make the launcher buffer
/// without bound; past this size the fragment is emitted.
inline constexpr std::size_t kMaxPendingLine = std::size_t{1} << 20;

struct OutputStream {
  int fd = -1;           // read end of the rank's pipe; -1 once closed
  int destination = -1;  // the launcher's own stdout or stderr
  std::string pending;   // bytes after the last newline seen so far
};

/// Sees every complete line a rank prints (without the newline), e.g. to follow its flight
/// recorder.
using LineObserver = std::function<void(std::string_view line)>;

/// Reads what is available; on EOF or an error, flushes and closes the stream.
void read_stream(const std::string& prefix, OutputStream& stream, const LineObserver& observe);
/// Flushes the pending fragment (as a line) and closes the stream.
void close_stream(const std::string& prefix, OutputStream& stream, const LineObserver& observe);

}  // namespace hp_run
