// hp-run: a small launcher for hyper_parallel programs, in the spirit of torchrun but without any
// dependency on libtorch (flags are parsed by CLI11, header-only).
//
//   hp-run --nproc-per-node N [--nnodes M] [--node-rank R] [--master-addr A]
//          [--master-port P] [--timeout S] [--grace S] -- program args...
//
// It starts N local ranks, each in its own process group with the usual RANK / WORLD_SIZE /
// MASTER_* environment, prefixes every line the ranks print with "[rank N] ", and tears the
// whole job down as soon as one rank fails, the timeout expires or the launcher itself is
// interrupted. The rooms: options (the command line), ports, signals, output (prefixing),
// diagnosis (the rank the others waited on), rank_process (starting a rank) and launcher (the
// poll loop of one attempt).

#include <unistd.h>

#include <exception>

#include "io.h"
#include "launcher.h"
#include "options.h"
#include "ports.h"
#include "signals.h"

namespace {

constexpr int kUsageExitCode = 2;
constexpr int kRuntimeErrorExitCode = 1;

}  // namespace

int main(int argc, char** argv) {
  using namespace hp_run;
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
    std::optional<Launcher::Clock::time_point> deadline;
    if (opts.timeout_s > 0) deadline = Launcher::Clock::now() + std::chrono::seconds(opts.timeout_s);
    Launcher launcher(opts, signals, deadline, {});
    return launcher.run().exit_code;
  } catch (const std::exception& e) {
    log_message(e.what());
    return kRuntimeErrorExitCode;
  }
}
