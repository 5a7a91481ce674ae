#pragma once
// One rank: a child process in a process group of its own (so that stopping it also reaches
// whatever it started), with the usual RANK / WORLD_SIZE / MASTER_* environment and its
// stdout and stderr piped to hp-run.

#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

#include "diagnosis.h"
#include "options.h"
#include "output.h"

namespace hp_run {

struct Rank {
  int local_rank = 0;
  std::string prefix;  // "[rank N] "
  pid_t pid = -1;      // also the id of the rank's process group
  bool running = false;
  OutputStream streams[2];  // stdout, stderr
  RankReport report;        // its global rank and what the diagnosis needs

  bool output_open() const { return streams[0].fd >= 0 || streams[1].fd >= 0; }
};

/// Starts `rank` running opts.command with `extra_env` added to the rank's environment (after
/// the rendezvous variables). Throws std::runtime_error if a pipe or fork fails.
void spawn(const Options& opts, Rank& rank,
           const std::vector<std::pair<std::string, std::string>>& extra_env);

/// "rank 1 was killed by signal SIGKILL (9)" / "rank 1 exited with code 3".
std::string describe_exit(int global_rank, int wait_status);
/// The exit code hp-run reports for a failed rank, shell-style (128 + signal if killed).
int exit_code_for(int wait_status);
bool is_failure(int wait_status);

}  // namespace hp_run
