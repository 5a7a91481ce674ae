// The harness of the hp-run tests: the real binary (HP_RUN_PATH) run with its
// stdout and stderr captured, and helpers to build small /bin/sh jobs.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#ifndef HP_RUN_PATH
#error "HP_RUN_PATH must name the hp-run executable"
#endif

namespace hp_run_test {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

struct Result {
  int exit_code = -1;   // exit status if hp-run exited normally
  int term_signal = 0;  // signal if hp-run itself was killed
  std::string out;
  std::string err;
  double seconds = 0;  // wall time from start to exit
};

// One running hp-run process with its stdout and stderr captured.
class Launch {
 public:
  explicit Launch(const std::vector<std::string>& args) : start_(Clock::now()) {
    int out[2];
    int err[2];
    if (::pipe(out) != 0 || ::pipe(err) != 0) throw std::runtime_error("pipe failed");
    std::vector<std::string> full{HP_RUN_PATH};
    full.insert(full.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& a : full) argv.push_back(a.data());
    argv.push_back(nullptr);

    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      for (int fd : {out[0], out[1], err[0], err[1]}) ::close(fd);
      ::execv(argv[0], argv.data());
      ::_exit(126);
    }
    ::close(out[1]);
    ::close(err[1]);
    fds_[0] = out[0];
    fds_[1] = err[0];
  }

  ~Launch() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    for (int fd : fds_) {
      if (fd >= 0) ::close(fd);
    }
  }

  Launch(const Launch&) = delete;
  Launch& operator=(const Launch&) = delete;

  pid_t pid() const { return pid_; }

  // Reads output until `needle` shows up on stdout or `limit` passes.
  bool wait_for_stdout(std::string_view needle, std::chrono::milliseconds limit) {
    return wait_for(result_.out, needle, limit);
  }

  // Reads output until `needle` shows up on stderr or `limit` passes.
  bool wait_for_stderr(std::string_view needle, std::chrono::milliseconds limit) {
    return wait_for(result_.err, needle, limit);
  }

  // Reads everything until hp-run closes its output, then reaps it. A
  // launcher that hangs is killed after 60 s so the test fails, not stalls.
  Result wait() {
    const auto deadline = Clock::now() + 60s;
    while (pump(deadline) && Clock::now() < deadline) {
    }
    if (fds_[0] >= 0 || fds_[1] >= 0) ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    reaped_ = true;
    result_.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    if (WIFEXITED(status)) result_.exit_code = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) result_.term_signal = WTERMSIG(status);
    return result_;
  }

 private:
  bool wait_for(const std::string& text, std::string_view needle, std::chrono::milliseconds limit) {
    const auto deadline = Clock::now() + limit;
    while (text.find(needle) == std::string::npos) {
      if (Clock::now() >= deadline || !pump(deadline)) return false;
    }
    return true;
  }

  // One poll round; returns false once both pipes are closed.
  bool pump(Clock::time_point deadline) {
    pollfd fds[2];
    nfds_t count = 0;
    std::string* sinks[2];
    int* owners[2];
    for (int i = 0; i < 2; ++i) {
      if (fds_[i] < 0) continue;
      fds[count] = pollfd{fds_[i], POLLIN, 0};
      sinks[count] = i == 0 ? &result_.out : &result_.err;
      owners[count] = &fds_[i];
      ++count;
    }
    if (count == 0) return false;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    const int rc = ::poll(fds, count, static_cast<int>(std::max<long long>(left.count(), 0)));
    if (rc < 0 && errno != EINTR) return false;
    for (nfds_t i = 0; i < count && rc > 0; ++i) {
      if (fds[i].revents == 0) continue;
      char buffer[65536];
      const ssize_t n = ::read(fds[i].fd, buffer, sizeof buffer);
      if (n > 0) {
        sinks[i]->append(buffer, static_cast<std::size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        ::close(*owners[i]);
        *owners[i] = -1;
      }
    }
    return true;
  }

  pid_t pid_ = -1;
  bool reaped_ = false;
  int fds_[2] = {-1, -1};
  Clock::time_point start_;
  Result result_;
};

inline Result run_hp_run(const std::vector<std::string>& args) { return Launch(args).wait(); }

// Another program's listener: a socket listening on an ephemeral port of an IPv4 `address`
// (host order, e.g. INADDR_LOOPBACK), closed when this goes.
class Listener {
 public:
  explicit Listener(uint32_t address = INADDR_LOOPBACK)
      : fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(address);
    socklen_t len = sizeof addr;
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(fd_, 1) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      throw std::runtime_error(std::string("Listener: cannot listen: ") + std::strerror(errno));
    }
    port_ = ntohs(addr.sin_port);
  }
  ~Listener() { ::close(fd_); }
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  int port() const { return port_; }

 private:
  int fd_;
  int port_ = 0;
};

// hp-run --nproc-per-node N <flags...> -- sh -c SCRIPT
inline std::vector<std::string> sh_job(int nproc, const std::string& script,
                                       std::vector<std::string> flags = {}) {
  std::vector<std::string> args{"--nproc-per-node", std::to_string(nproc)};
  args.insert(args.end(), flags.begin(), flags.end());
  args.insert(args.end(), {"--", "/bin/sh", "-c", script});
  return args;
}

inline std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  return lines;
}

inline bool has_line(const std::string& text, const std::string& line) {
  for (const std::string& l : lines_of(text)) {
    if (l == line) return true;
  }
  return false;
}

inline std::string describe(const Result& r) {
  return "exit " + std::to_string(r.exit_code) + " signal " + std::to_string(r.term_signal) +
         "\n--- stdout ---\n" + r.out.substr(0, 4000) + "\n--- stderr ---\n" + r.err.substr(0, 4000);
}

}  // namespace hp_run_test
