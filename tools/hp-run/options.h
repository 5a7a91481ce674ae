#pragma once
// hp-run's command line: its own flags before "--", the program and its arguments after it.

#include <stdexcept>
#include <string>
#include <vector>

namespace hp_run {

struct Options {
  int nproc_per_node = 0;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  int timeout_s = 0;  // the whole job, every attempt included
  int grace_s = 5;
  int max_restarts = 0;
  int restart_backoff_s = 1;
  int preempt_grace_s = 20;
  std::vector<std::string> command;
};

/// A bad command line; main prints it with a pointer to --help and exits 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// --help: main prints `text` and exits 0.
struct HelpRequested {
  std::string text;
};

/// Parses argv with CLI11; throws UsageError or HelpRequested.
Options parse_args(int argc, char** argv);

}  // namespace hp_run
