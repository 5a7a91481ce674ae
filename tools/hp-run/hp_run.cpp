// hp-run: a small launcher for hyper_parallel programs, in the spirit of
// torchrun but without any dependency on libtorch.
//
//   hp-run --nproc-per-node N [--nnodes M] [--node-rank R] [--master-addr A]
//          [--master-port P] [--timeout S] [--grace S] -- program args...
//
// Flags are parsed by CLI11 (Debian's libcli11-dev, header-only), so the launcher still needs
// nothing but the C++ standard library at run time.
//
// It starts N local ranks, each in its own process group with the usual
// RANK / WORLD_SIZE / MASTER_* environment, prefixes every line the ranks
// print with "[rank N] ", and tears the whole job down as soon as one rank
// fails, the timeout expires or the launcher itself is interrupted.
//
// The launcher is single-threaded: one poll() loop watches every output pipe
// plus a self-pipe that the signal handlers write to, so there is no way for
// a chatty rank to deadlock it and no work is done inside signal handlers.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

extern char** environ;

namespace {

constexpr int kUsageExitCode = 2;
constexpr int kRuntimeErrorExitCode = 1;
constexpr int kTimeoutExitCode = 124;     // same convention as timeout(1)
constexpr int kExecFailedExitCode = 127;  // same convention as the shell

// A rank that prints an enormous line without a newline must not make the
// launcher buffer without bound; past this size the fragment is emitted.
constexpr std::size_t kMaxPendingLine = std::size_t{1} << 20;

// After the last rank has exited, its output is already sitting in the pipe
// (a rank cannot exit while blocked on a full pipe), so a short drain period
// is enough. It only matters when a rank left a background process behind
// that still holds the pipe open; we must not wait for that forever.
constexpr std::chrono::milliseconds kDrainAfterExit{1000};

constexpr const char* kDescription =
    R"(usage: hp-run --nproc-per-node N [options] -- program [args...]

Starts N copies of program on this node, one per local rank, and prefixes
every line they print with "[rank R] ". Flags also take --flag=value.)";

constexpr const char* kFooter =
    R"(Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR and MASTER_PORT in its environment.

exit status: 0 if every rank succeeded; the first failing rank's exit code
(128+signal if it was killed); 124 on timeout; 128+signal if hp-run was
interrupted; 2 on a usage error.)";

// ---------------------------------------------------------------------------
// Small I/O helpers. Everything goes through write(2) rather than stdio so
// that the launcher's own messages and the ranks' lines never sit in
// different user-space buffers and come out in the wrong order.

void write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // stdout/stderr is gone; there is nowhere left to report to
    }
    data.remove_prefix(static_cast<std::size_t>(n));
  }
}

void log_message(const std::string& message) {
  write_all(STDERR_FILENO, "hp-run: " + message + "\n");
}

std::string errno_text(int error) { return std::strerror(error); }

// "SIGSEGV (11)". A table rather than sigabbrev_np() keeps this portable.
std::string describe_signal(int sig) {
  static constexpr std::pair<int, const char*> kNames[] = {
      {SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"}, {SIGILL, "SIGILL"},
      {SIGTRAP, "SIGTRAP"}, {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},
      {SIGKILL, "SIGKILL"}, {SIGUSR1, "SIGUSR1"}, {SIGSEGV, "SIGSEGV"}, {SIGUSR2, "SIGUSR2"},
      {SIGPIPE, "SIGPIPE"}, {SIGALRM, "SIGALRM"}, {SIGTERM, "SIGTERM"}, {SIGXCPU, "SIGXCPU"},
      {SIGXFSZ, "SIGXFSZ"}, {SIGSYS, "SIGSYS"},
  };
  for (const auto& [number, name] : kNames) {
    if (number == sig) return std::string(name) + " (" + std::to_string(sig) + ")";
  }
  return std::to_string(sig);
}

// ---------------------------------------------------------------------------
// Command line.

struct Options {
  int nproc_per_node = 0;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  int timeout_s = 0;
  int grace_s = 5;
  std::vector<std::string> command;
};

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct HelpRequested {
  std::string text;
};

constexpr long long kIntMax = 2147483647;

// A CLI11 check that the value is an integer in [lo, hi]; its message names the value (CLI11
// prefixes the flag): "--timeout: expected a non-negative integer (seconds), got 'soon'".
CLI::Validator integer_in(long long lo, long long hi, const std::string& expectation) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        long long value = 0;
        const char* end = text.data() + text.size();
        const auto [stop, error] = std::from_chars(text.data(), end, value);
        if (text.empty() || error != std::errc() || stop != end || value < lo || value > hi) {
          return "expected " + expectation + ", got '" + text + "'";
        }
        return {};
      },
      expectation);
}

// Checks that need every flag to be known first.
void validate(const Options& opts) {
  if (opts.node_rank >= opts.nnodes) {
    throw UsageError("--node-rank: expected a value in [0, " + std::to_string(opts.nnodes) +
                     ") for --nnodes " + std::to_string(opts.nnodes) + ", got " +
                     std::to_string(opts.node_rank));
  }
  if (opts.master_port == 0 && opts.nnodes > 1) {
    // Every node would pick a different port, so they could never meet.
    throw UsageError(
        "--master-port 0 (pick a free port) only works with --nnodes 1; give every node the "
        "same port");
  }
  if (static_cast<long long>(opts.nnodes) * opts.nproc_per_node > kIntMax) {
    throw UsageError("--nnodes * --nproc-per-node is too large");
  }
}

// hp-run's own flags come before "--"; everything after it is the program and its arguments,
// passed on untouched (they may look like flags).
Options parse_args(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  const auto separator = std::find(args.begin(), args.end(), "--");
  Options opts;
  CLI::App app(kDescription, "hp-run");
  app.footer(kFooter);
  app.allow_extras();  // reported below in hp-run's own words
  app.add_option("--nproc-per-node", opts.nproc_per_node,
                 "processes (ranks) to start on this node")
      ->required()
      ->check(integer_in(1, kIntMax, "a positive integer"));
  app.add_option("--nnodes", opts.nnodes, "number of nodes in the job")
      ->capture_default_str()
      ->check(integer_in(1, kIntMax, "a positive integer"));
  app.add_option("--node-rank", opts.node_rank, "index of this node, 0 <= R < nnodes")
      ->capture_default_str()
      ->check(integer_in(0, kIntMax, "a non-negative integer"));
  app.add_option("--master-addr", opts.master_addr, "address of the rendezvous master")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& text) { return text.empty() ? std::string("expected a non-empty address") : ""; },
          "ADDRESS"));
  app.add_option("--master-port", opts.master_port,
                 "port of the rendezvous master; 0 picks a free port (only with --nnodes 1)")
      ->capture_default_str()
      ->check(integer_in(0, 65535, "an integer in [0, 65535]"));
  app.add_option("--timeout", opts.timeout_s, "kill all ranks after S seconds; 0 = never")
      ->capture_default_str()
      ->check(integer_in(0, kIntMax, "a non-negative integer (seconds)"));
  app.add_option("--grace", opts.grace_s, "seconds between SIGTERM and SIGKILL")
      ->capture_default_str()
      ->check(integer_in(0, kIntMax, "a non-negative integer (seconds)"));
  try {
    app.parse(std::vector<std::string>(std::make_reverse_iterator(separator), args.rend()));
  } catch (const CLI::CallForHelp&) {
    throw HelpRequested{app.help()};
  } catch (const CLI::ArgumentMismatch& e) {
    // CLI11 says "--nnodes: 1 required INT:... missing"; name the flag and the problem.
    const std::string text = e.what();
    throw UsageError(text.substr(0, text.find(':')) + ": missing value");
  } catch (const CLI::ParseError& e) {
    throw UsageError(e.what());
  }
  for (const auto& extra : app.remaining()) {
    if (extra.starts_with("-")) throw UsageError("unknown flag '" + extra.substr(0, extra.find('=')) + "'");
    throw UsageError("expected '--' followed by a program to run (got '" + extra + "')");
  }
  validate(opts);
  if (separator == args.end() || separator + 1 == args.end()) {
    throw UsageError("expected '--' followed by a program to run");
  }
  opts.command.assign(separator + 1, args.end());
  return opts;
}

// ---------------------------------------------------------------------------
// Environment setup.

// If hp-run was started with stdin/stdout/stderr closed, pipe() could hand
// out fd 0-2 and dup2() in the child would silently misroute output.
void ensure_standard_fds_open() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) == -1 && errno == EBADF) {
      const int opened = ::open("/dev/null", O_RDWR);
      if (opened >= 0 && opened != fd) {
        ::dup2(opened, fd);
        ::close(opened);
      }
    }
  }
}

// Asks the kernel for a free port by binding port 0 on the master address.
// The socket is closed again, so there is a small window in which someone
// else could take the port, but unlike a fixed default it lets concurrent
// single-node jobs (ctest -j) run side by side.
int pick_free_port(const std::string& address) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(address.c_str(), "0", &hints, &found);
  if (rc != 0) {
    throw std::runtime_error("cannot resolve --master-addr '" + address +
                             "': " + ::gai_strerror(rc));
  }
  const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(found, &::freeaddrinfo);

  std::string last_error = "no usable address";
  for (const addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last_error = errno_text(errno);
      continue;
    }
    sockaddr_storage bound{};
    socklen_t length = sizeof bound;
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) == 0) {
      ::close(fd);
      const in_port_t port = bound.ss_family == AF_INET6
                                 ? reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port
                                 : reinterpret_cast<const sockaddr_in*>(&bound)->sin_port;
      return ntohs(port);
    }
    last_error = errno_text(errno);
    ::close(fd);
  }
  throw std::runtime_error("cannot pick a free port on '" + address + "': " + last_error);
}

// ---------------------------------------------------------------------------
// Signals, via the self-pipe trick: the handler only writes the signal number
// into a pipe, and the poll() loop picks it up like any other input.

// The one piece of global state: the handler cannot reach anything else.
volatile sig_atomic_t g_signal_pipe_write_fd = -1;

extern "C" void record_signal(int sig) {
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  // If the pipe is full, earlier bytes are still pending and the loop will
  // wake up anyway; SIGCHLDs coalesce and are handled by a waitpid() loop.
  [[maybe_unused]] const ssize_t written = ::write(g_signal_pipe_write_fd, &byte, 1);
  errno = saved_errno;
}

constexpr int kHandledSignals[] = {SIGINT, SIGTERM, SIGCHLD};

class SignalPipe {
 public:
  SignalPipe() {
    if (::pipe2(fds_, O_CLOEXEC | O_NONBLOCK) != 0) {
      throw std::runtime_error("pipe: " + errno_text(errno));
    }
    g_signal_pipe_write_fd = fds_[1];
    struct sigaction action {};
    action.sa_handler = record_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    for (const int sig : kHandledSignals) ::sigaction(sig, &action, nullptr);
    // A closed stdout must not kill the launcher before it has cleaned up.
    ::signal(SIGPIPE, SIG_IGN);
  }
  ~SignalPipe() {
    for (const int sig : kHandledSignals) ::signal(sig, SIG_DFL);
    g_signal_pipe_write_fd = -1;
    ::close(fds_[0]);
    ::close(fds_[1]);
  }
  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;

  int read_fd() const { return fds_[0]; }

  std::vector<int> take_pending() {
    std::vector<int> signals;
    unsigned char buffer[64];
    ssize_t n;
    while ((n = ::read(fds_[0], buffer, sizeof buffer)) > 0) {
      signals.insert(signals.end(), buffer, buffer + n);
    }
    return signals;
  }

 private:
  int fds_[2] = {-1, -1};
};

// Blocks the handled signals for its lifetime. Used around fork() so that a
// signal arriving in the child before exec cannot run our handler there and
// write into the (shared) self-pipe, which the parent would misread.
class ScopedSignalBlock {
 public:
  ScopedSignalBlock() {
    sigset_t blocked;
    sigemptyset(&blocked);
    for (const int sig : kHandledSignals) sigaddset(&blocked, sig);
    ::sigprocmask(SIG_BLOCK, &blocked, &previous_);
  }
  ~ScopedSignalBlock() { ::sigprocmask(SIG_SETMASK, &previous_, nullptr); }
  ScopedSignalBlock(const ScopedSignalBlock&) = delete;
  ScopedSignalBlock& operator=(const ScopedSignalBlock&) = delete;

  const sigset_t& previous() const { return previous_; }

 private:
  sigset_t previous_;
};

// ---------------------------------------------------------------------------
// Ranks and their output.

struct OutputStream {
  int fd = -1;           // read end of the rank's pipe; -1 once closed
  int destination = -1;  // the launcher's own stdout or stderr
  std::string pending;   // bytes after the last newline seen so far
};

struct Rank {
  int local_rank = 0;
  int global_rank = 0;
  std::string prefix;  // "[rank N] "
  pid_t pid = -1;      // also the id of the rank's process group
  bool running = false;
  bool unresponsive = false;  // still running when the grace after SIGTERM ran out
  OutputStream streams[2];    // stdout, stderr
  // From the rank's last "hp-waiting-on:" line (hyper_parallel's flight recorder): the global
  // rank it was waiting for, -1 for "none"; unset if it printed no such line.
  std::optional<int> waiting_on;
};

// "hp-waiting-on: rank R peer P op ..." -> P; "hp-waiting-on: rank R none" -> -1.
std::optional<int> parse_waiting_on(std::string_view line) {
  constexpr std::string_view kTag = "hp-waiting-on: rank ";
  const auto at = line.find(kTag);
  if (at == std::string_view::npos) return std::nullopt;
  line.remove_prefix(at + kTag.size());
  const auto space = line.find(' ');
  if (space == std::string_view::npos) return std::nullopt;
  line.remove_prefix(space + 1);
  if (line.starts_with("none")) return -1;
  if (!line.starts_with("peer ")) return std::nullopt;
  line.remove_prefix(5);
  int peer = -1;
  const auto [end, error] = std::from_chars(line.data(), line.data() + line.size(), peer);
  if (error != std::errc() || peer < 0) return std::nullopt;
  return peer;
}

// Emits every complete line in `stream.pending` with the rank prefix, in a
// single write() so lines from different ranks never interleave mid-line.
void emit_lines(Rank& rank, OutputStream& stream, bool at_eof) {
  std::string out;
  std::size_t start = 0;
  for (std::size_t newline; (newline = stream.pending.find('\n', start)) != std::string::npos;
       start = newline + 1) {
    const std::string_view line(stream.pending.data() + start, newline - start);
    // A rank's report of whom it waited for outlives a later "none" (e.g. its SIGTERM report
    // after the failure it already reported).
    const bool had_peer = rank.waiting_on && *rank.waiting_on >= 0;
    if (auto peer = parse_waiting_on(line); peer && !(had_peer && *peer < 0)) {
      rank.waiting_on = peer;
    }
    out += rank.prefix;
    out.append(stream.pending, start, newline + 1 - start);
  }
  stream.pending.erase(0, start);
  const bool flush_fragment = at_eof || stream.pending.size() >= kMaxPendingLine;
  if (flush_fragment && !stream.pending.empty()) {
    out += rank.prefix;
    out += stream.pending;
    out += '\n';
    stream.pending.clear();
  }
  write_all(stream.destination, out);
}

void close_stream(Rank& rank, OutputStream& stream) {
  emit_lines(rank, stream, /*at_eof=*/true);
  ::close(stream.fd);
  stream.fd = -1;
}

void read_stream(Rank& rank, OutputStream& stream) {
  char buffer[65536];
  const ssize_t n = ::read(stream.fd, buffer, sizeof buffer);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;  // poll again
  if (n <= 0) {
    close_stream(rank, stream);
    return;
  }
  stream.pending.append(buffer, static_cast<std::size_t>(n));
  emit_lines(rank, stream, /*at_eof=*/false);
}

std::string describe_exit(int global_rank, int wait_status) {
  const std::string who = "rank " + std::to_string(global_rank);
  if (WIFSIGNALED(wait_status)) {
    return who + " was killed by signal " + describe_signal(WTERMSIG(wait_status));
  }
  return who + " exited with code " + std::to_string(WEXITSTATUS(wait_status));
}

// The exit code hp-run reports for a failed rank, shell-style.
int exit_code_for(int wait_status) {
  return WIFSIGNALED(wait_status) ? 128 + WTERMSIG(wait_status) : WEXITSTATUS(wait_status);
}

bool is_failure(int wait_status) {
  return WIFSIGNALED(wait_status) || WEXITSTATUS(wait_status) != 0;
}

// Holds the argv/envp arrays for execvp, built before fork() so the child
// only has to call async-signal-safe functions.
struct ExecArgs {
  std::vector<std::string> env_strings;
  std::vector<char*> argv;
  std::vector<char*> envp;
  std::string error_prefix;  // "hp-run: cannot run 'prog': "
};

ExecArgs build_exec_args(const Options& opts, const Rank& rank) {
  const std::pair<std::string, std::string> overrides[] = {
      {"RANK", std::to_string(rank.global_rank)},
      {"LOCAL_RANK", std::to_string(rank.local_rank)},
      {"WORLD_SIZE", std::to_string(opts.nnodes * opts.nproc_per_node)},
      {"LOCAL_WORLD_SIZE", std::to_string(opts.nproc_per_node)},
      {"GROUP_RANK", std::to_string(opts.node_rank)},
      {"MASTER_ADDR", opts.master_addr},
      {"MASTER_PORT", std::to_string(opts.master_port)},
  };
  ExecArgs exec;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string_view text(*entry);
    const std::string_view name = text.substr(0, text.find('='));
    const bool overridden = std::any_of(std::begin(overrides), std::end(overrides),
                                        [&](const auto& kv) { return kv.first == name; });
    if (!overridden) exec.env_strings.emplace_back(text);
  }
  for (const auto& [name, value] : overrides) exec.env_strings.push_back(name + "=" + value);

  for (std::string& s : exec.env_strings) exec.envp.push_back(s.data());
  exec.envp.push_back(nullptr);
  for (const std::string& arg : opts.command) exec.argv.push_back(const_cast<char*>(arg.c_str()));
  exec.argv.push_back(nullptr);
  exec.error_prefix = "hp-run: cannot run '" + opts.command.front() + "': ";
  return exec;
}

// Runs in the forked child: never returns.
[[noreturn]] void exec_rank(ExecArgs& exec, int stdout_fd, int stderr_fd,
                            const sigset_t& original_mask) {
  // Own process group, so that killing the rank also reaches anything it
  // started (shell pipelines, dataloader workers, ...).
  ::setpgid(0, 0);
  for (const int sig : kHandledSignals) ::signal(sig, SIG_DFL);
  ::signal(SIGPIPE, SIG_DFL);  // ignored dispositions survive exec; undo ours
  ::sigprocmask(SIG_SETMASK, &original_mask, nullptr);
  ::dup2(stdout_fd, STDOUT_FILENO);
  ::dup2(stderr_fd, STDERR_FILENO);
  environ = exec.envp.data();
  ::execvp(exec.argv[0], exec.argv.data());
  const int error = errno;
  write_all(STDERR_FILENO, exec.error_prefix);
  write_all(STDERR_FILENO, std::strerror(error));
  write_all(STDERR_FILENO, "\n");
  ::_exit(kExecFailedExitCode);
}

// ---------------------------------------------------------------------------
// The launcher proper.

class Launcher {
 public:
  Launcher(Options opts, SignalPipe& signals) : opts_(std::move(opts)), signals_(signals) {}
  ~Launcher() { kill_and_reap_leftovers(); }
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  int run() {
    spawn_all();
    if (opts_.timeout_s > 0)
      timeout_deadline_ = Clock::now() + std::chrono::seconds(opts_.timeout_s);
    event_loop();
    return finish();
  }

 private:
  using Clock = std::chrono::steady_clock;
  enum class StopReason { kNone, kRankFailed, kTimeout, kSignal };

  void spawn_all() {
    ranks_.resize(static_cast<std::size_t>(opts_.nproc_per_node));
    for (int local = 0; local < opts_.nproc_per_node; ++local) {
      Rank& rank = ranks_[static_cast<std::size_t>(local)];
      rank.local_rank = local;
      rank.global_rank = opts_.node_rank * opts_.nproc_per_node + local;
      rank.prefix = "[rank " + std::to_string(rank.global_rank) + "] ";
      spawn(rank);
    }
  }

  void spawn(Rank& rank) {
    ExecArgs exec = build_exec_args(opts_, rank);
    int out[2];
    int err[2];
    // O_CLOEXEC keeps every rank from inheriting the other ranks' pipes;
    // dup2() clears the flag on the copies the child actually uses.
    if (::pipe2(out, O_CLOEXEC) != 0) throw std::runtime_error("pipe: " + errno_text(errno));
    if (::pipe2(err, O_CLOEXEC) != 0) {
      const int error = errno;
      ::close(out[0]);
      ::close(out[1]);
      throw std::runtime_error("pipe: " + errno_text(error));
    }
    pid_t pid;
    int fork_error;
    {
      ScopedSignalBlock block;
      pid = ::fork();
      if (pid == 0) exec_rank(exec, out[1], err[1], block.previous());
      fork_error = errno;
    }
    ::close(out[1]);
    ::close(err[1]);
    if (pid < 0) {
      ::close(out[0]);
      ::close(err[0]);
      throw std::runtime_error("fork: " + errno_text(fork_error));
    }
    // Also set the group from the parent, so it exists before we might
    // signal it; the child's own setpgid() may not have run yet.
    ::setpgid(pid, pid);
    rank.pid = pid;
    rank.running = true;
    rank.streams[0] = OutputStream{out[0], STDOUT_FILENO, {}};
    rank.streams[1] = OutputStream{err[0], STDERR_FILENO, {}};
    ++running_;
  }

  void event_loop() {
    std::vector<pollfd> fds;
    std::vector<std::pair<Rank*, OutputStream*>> owners;
    while (!done(Clock::now())) {
      fds.assign(1, pollfd{signals_.read_fd(), POLLIN, 0});
      owners.clear();
      for (Rank& rank : ranks_) {
        for (OutputStream& stream : rank.streams) {
          if (stream.fd < 0) continue;
          fds.push_back(pollfd{stream.fd, POLLIN, 0});
          owners.emplace_back(&rank, &stream);
        }
      }
      const int ready = ::poll(fds.data(), fds.size(), poll_timeout_ms(Clock::now()));
      if (ready < 0 && errno != EINTR) throw std::runtime_error("poll: " + errno_text(errno));
      if (ready > 0) {
        if (fds[0].revents != 0) handle_signals();
        for (std::size_t i = 1; i < fds.size(); ++i) {
          if (fds[i].revents != 0) read_stream(*owners[i - 1].first, *owners[i - 1].second);
        }
      }
      check_deadlines(Clock::now());
    }
    // Anything still open belongs to a background process a rank left
    // behind. When the job is being torn down, that process goes too.
    if (stop_ != StopReason::kNone) kill_all(SIGKILL);
    for (Rank& rank : ranks_) {
      for (OutputStream& stream : rank.streams) {
        if (stream.fd >= 0) close_stream(rank, stream);
      }
    }
  }

  bool done(Clock::time_point now) const {
    if (running_ > 0) return false;
    const bool output_open = std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& rank) {
      return rank.streams[0].fd >= 0 || rank.streams[1].fd >= 0;
    });
    return !output_open || (drain_deadline_ && now >= *drain_deadline_);
  }

  int poll_timeout_ms(Clock::time_point now) const {
    std::optional<Clock::time_point> next;
    for (const auto& deadline : {timeout_deadline_, kill_deadline_, drain_deadline_}) {
      if (deadline && (!next || *deadline < *next)) next = deadline;
    }
    if (!next) return -1;
    if (*next <= now) return 0;
    // Round up so we do not wake a millisecond early and spin.
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(*next - now).count();
    return static_cast<int>(std::min<long long>(ms, 60'000));
  }

  void handle_signals() {
    for (const int sig : signals_.take_pending()) {
      if (sig == SIGINT || sig == SIGTERM) on_launcher_signal(sig);
    }
    reap_children();  // cheap, and SIGCHLDs may have coalesced
  }

  void on_launcher_signal(int sig) {
    if (stop_ == StopReason::kNone) {
      log_message("received " + describe_signal(sig) + "; terminating all ranks");
      begin_shutdown(StopReason::kSignal, 128 + sig);
    } else {
      // Already shutting down and the user insists: don't wait for grace.
      log_message("received " + describe_signal(sig) + " again; killing all ranks now");
      kill_all(SIGKILL);
      kill_deadline_.reset();
    }
  }

  void reap_children() {
    int status = 0;
    pid_t pid;
    while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
      const auto it = std::find_if(ranks_.begin(), ranks_.end(),
                                   [pid](const Rank& rank) { return rank.pid == pid; });
      if (it != ranks_.end() && it->running) on_rank_exit(*it, status);
    }
  }

  void on_rank_exit(Rank& rank, int status) {
    rank.running = false;
    --running_;
    // Failures after shutdown began are mostly our own SIGTERM; only the
    // first, spontaneous failure explains what went wrong.
    if (is_failure(status) && stop_ == StopReason::kNone) {
      failure_message_ = describe_exit(rank.global_rank, status);
      begin_shutdown(StopReason::kRankFailed, exit_code_for(status));
    }
    if (running_ == 0) {
      timeout_deadline_.reset();
      drain_deadline_ = Clock::now() + kDrainAfterExit;
    }
  }

  void begin_shutdown(StopReason reason, int exit_code) {
    stop_ = reason;
    exit_code_ = exit_code;
    timeout_deadline_.reset();
    if (running_ == 0) return;
    kill_all(SIGTERM);
    kill_deadline_ = Clock::now() + std::chrono::seconds(opts_.grace_s);
  }

  void check_deadlines(Clock::time_point now) {
    if (timeout_deadline_ && now >= *timeout_deadline_) {
      log_message("timeout after " + std::to_string(opts_.timeout_s) + " s; killing all ranks");
      begin_shutdown(StopReason::kTimeout, kTimeoutExitCode);
    }
    if (kill_deadline_ && now >= *kill_deadline_) {
      kill_deadline_.reset();
      std::string names;
      for (const Rank& rank : ranks_) {
        if (rank.running) names += (names.empty() ? "" : ", ") + std::to_string(rank.global_rank);
      }
      if (!names.empty()) {
        log_message("rank(s) " + names + " still running " + std::to_string(opts_.grace_s) +
                    " s after SIGTERM; sending SIGKILL");
      }
      for (Rank& rank : ranks_) {
        if (rank.running) rank.unresponsive = true;
      }
      kill_all(SIGKILL);
    }
  }

  // Signals the process group of every rank that is still running. For
  // SIGKILL, also groups whose leader is gone but whose pipes are still held
  // open: that can only be a leftover child of the rank. (The group id cannot
  // be reused while any member of the group is alive.)
  void kill_all(int sig) {
    for (const Rank& rank : ranks_) {
      const bool output_open = rank.streams[0].fd >= 0 || rank.streams[1].fd >= 0;
      if (rank.running || (sig == SIGKILL && output_open)) ::killpg(rank.pid, sig);
    }
  }

  int finish() {
    if (stop_ == StopReason::kRankFailed) log_message(failure_message_);
    if (stop_ != StopReason::kNone) report_waited_on();
    return stop_ == StopReason::kNone ? 0 : exit_code_;
  }

  // From the ranks' hp-waiting-on lines: follow "R waits for P" until a rank that waits for
  // nobody (stuck outside any collective) or printed nothing (frozen, or gone); that is the rank
  // the others were waiting on. The rank that noticed first is often only its neighbour.
  void report_waited_on() const {
    const Rank* any_waiting = nullptr;
    for (const Rank& rank : ranks_) {
      if (rank.waiting_on && *rank.waiting_on >= 0) any_waiting = &rank;
    }
    if (any_waiting == nullptr) return;
    auto find = [&](int global) -> const Rank* {
      for (const Rank& rank : ranks_) {
        if (rank.global_rank == global) return &rank;
      }
      return nullptr;
    };
    std::vector<int> culprits, waiters;
    for (const Rank& rank : ranks_) {
      if (!rank.waiting_on || *rank.waiting_on < 0) continue;
      waiters.push_back(rank.global_rank);
      int at = *rank.waiting_on;
      for (size_t hops = 0; hops <= ranks_.size(); ++hops) {
        const Rank* next = find(at);
        if (next == nullptr || !next->waiting_on || *next->waiting_on < 0) break;
        at = *next->waiting_on;
      }
      if (std::find(culprits.begin(), culprits.end(), at) == culprits.end()) culprits.push_back(at);
    }
    auto list = [](const std::vector<int>& v) {
      std::string text;
      for (int x : v) text += (text.empty() ? "" : ", ") + std::to_string(x);
      return text;
    };
    for (int culprit : culprits) {
      const Rank* rank = find(culprit);
      std::string state = "not on this node";
      if (rank != nullptr) {
        if (rank->unresponsive) {
          state = "unresponsive: it did not exit on SIGTERM (stopped or hung in the kernel?)";
        } else if (!rank->waiting_on) {
          state = "it printed no flight-recorder line";
        } else {
          state = "it was not inside a collective (stuck in its own code?)";
        }
      }
      log_message("rank(s) " + list(waiters) + " were waiting on rank " + std::to_string(culprit) +
                  "; " + state);
    }
  }

  // Only reached with running ranks if something threw (e.g. fork failed
  // half-way through spawning): don't leave orphans behind.
  void kill_and_reap_leftovers() {
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

  Options opts_;
  SignalPipe& signals_;
  std::vector<Rank> ranks_;
  int running_ = 0;
  StopReason stop_ = StopReason::kNone;
  int exit_code_ = 0;
  std::string failure_message_;
  std::optional<Clock::time_point> timeout_deadline_;
  std::optional<Clock::time_point> kill_deadline_;
  std::optional<Clock::time_point> drain_deadline_;
};

}  // namespace

int main(int argc, char** argv) {
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
    if (opts.master_port == 0) opts.master_port = pick_free_port(opts.master_addr);
    SignalPipe signals;
    Launcher launcher(std::move(opts), signals);
    return launcher.run();
  } catch (const std::exception& e) {
    log_message(e.what());
    return kRuntimeErrorExitCode;
  }
}
