#include "rank_process.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string_view>

#include "io.h"
#include "signals.h"

extern char** environ;

namespace hp_run {
namespace {

constexpr int kExecFailedExitCode = 127;  // same convention as the shell

// The argv/envp arrays for execvp, built before fork() so the child only has to call
// async-signal-safe functions.
struct ExecArgs {
  std::vector<std::string> env_strings;
  std::vector<char*> argv;
  std::vector<char*> envp;
  std::string error_prefix;  // "hp-run: cannot run 'prog': "
};

ExecArgs build_exec_args(const Options& opts, const Rank& rank,
                         const std::vector<std::pair<std::string, std::string>>& extra_env) {
  std::vector<std::pair<std::string, std::string>> overrides{
      {"RANK", std::to_string(rank.report.global_rank)},
      {"LOCAL_RANK", std::to_string(rank.local_rank)},
      {"WORLD_SIZE", std::to_string(opts.nnodes * opts.nproc_per_node)},
      {"LOCAL_WORLD_SIZE", std::to_string(opts.nproc_per_node)},
      {"GROUP_RANK", std::to_string(opts.node_rank)},
      {"MASTER_ADDR", opts.master_addr},
      {"MASTER_PORT", std::to_string(opts.master_port)},
  };
  overrides.insert(overrides.end(), extra_env.begin(), extra_env.end());
  ExecArgs exec;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string_view text(*entry);
    const std::string_view name = text.substr(0, text.find('='));
    const bool overridden =
        std::any_of(overrides.begin(), overrides.end(), [&](const auto& kv) { return kv.first == name; });
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
[[noreturn]] void exec_rank(ExecArgs& exec, int stdout_fd, int stderr_fd, const sigset_t& original_mask) {
  // Own process group, so that killing the rank also reaches anything it started (shell
  // pipelines, dataloader workers, ...).
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

}  // namespace

void spawn(const Options& opts, Rank& rank,
           const std::vector<std::pair<std::string, std::string>>& extra_env) {
  ExecArgs exec = build_exec_args(opts, rank, extra_env);
  int out[2];
  int err[2];
  // O_CLOEXEC keeps every rank from inheriting the other ranks' pipes; dup2() clears the flag
  // on the copies the child actually uses.
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
  // Also set the group from the parent, so it exists before hp-run might signal it; the
  // child's own setpgid() may not have run yet.
  ::setpgid(pid, pid);
  rank.pid = pid;
  rank.running = true;
  rank.streams[0] = OutputStream{out[0], STDOUT_FILENO, {}};
  rank.streams[1] = OutputStream{err[0], STDERR_FILENO, {}};
}

std::string describe_exit(int global_rank, int wait_status) {
  const std::string who = "rank " + std::to_string(global_rank);
  if (WIFSIGNALED(wait_status))
    return who + " was killed by signal " + describe_signal(WTERMSIG(wait_status));
  return who + " exited with code " + std::to_string(WEXITSTATUS(wait_status));
}

int exit_code_for(int wait_status) {
  return WIFSIGNALED(wait_status) ? 128 + WTERMSIG(wait_status) : WEXITSTATUS(wait_status);
}

bool is_failure(int wait_status) { return WIFSIGNALED(wait_status) || WEXITSTATUS(wait_status) != 0; }

}  // namespace hp_run
