#include "output.h"

#include <unistd.h>

#include <cerrno>

#include "io.h"

namespace hp_run {
namespace {

// Emits every complete line in `stream.pending` with the prefix, in a single write().
void emit_lines(const std::string& prefix, OutputStream& stream, bool at_eof, const LineObserver& observe) {
  std::string out;
  std::size_t start = 0;
  for (std::size_t newline; (newline = stream.pending.find('\n', start)) != std::string::npos;
       start = newline + 1) {
    if (observe) observe(std::string_view(stream.pending.data() + start, newline - start));
    out += prefix;
    out.append(stream.pending, start, newline + 1 - start);
  }
  stream.pending.erase(0, start);
  const bool flush_fragment = at_eof || stream.pending.size() >= kMaxPendingLine;
  if (flush_fragment && !stream.pending.empty()) {
    out += prefix;
    out += stream.pending;
    out += '\n';
    stream.pending.clear();
  }
  write_all(stream.destination, out);
}

}  // namespace

void close_stream(const std::string& prefix, OutputStream& stream, const LineObserver& observe) {
  emit_lines(prefix, stream, /*at_eof=*/true, observe);
  ::close(stream.fd);
  stream.fd = -1;
}

void read_stream(const std::string& prefix, OutputStream& stream, const LineObserver& observe) {
  char buffer[65536];
  const ssize_t n = ::read(stream.fd, buffer, sizeof buffer);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;  // poll again
  if (n <= 0) {
    close_stream(prefix, stream, observe);
    return;
  }
  stream.pending.append(buffer, static_cast<std::size_t>(n));
  emit_lines(prefix, stream, /*at_eof=*/false, observe);
}

}  // namespace hp_run
