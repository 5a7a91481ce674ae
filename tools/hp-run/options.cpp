#include "options.h"

#include <algorithm>
#include <charconv>
#include <iterator>

#include <CLI/CLI.hpp>

namespace hp_run {
namespace {

constexpr const char* kDescription =
    R"(usage: hp-run --nproc-per-node N [options] -- program [args...]

Starts N copies of program on this node, one per local rank, and prefixes
every line they print with "[rank R] ". Flags also take --flag=value.)";

constexpr const char* kFooter =
    R"(Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT and HP_RESTART_COUNT in its
environment.

The rendezvous port: on the node of rank 0 (--node-rank 0), hp-run holds it bound,
beside rank 0's store, while each attempt runs, so that no other program can take
it; a port another program holds there fails the attempt before any rank starts.

Restarts: with --max-restarts N, a failed attempt (a rank's non-zero exit or signal;
a stuck rank makes the others time out and fail) stops every rank, and all of them
are started again, up to N times. Attempt k rendezvouses on --master-port + k, on
every node (a fixed port is needed with --nnodes > 1); each node's hp-run restarts
when a rank of its own fails, which a failure on any node causes through broken
transfers or HP_TIMEOUT_S. --timeout covers the whole job, every attempt included.

Preemption: SIGTERM or SIGINT to hp-run sends SIGUSR1 to every rank, which may
checkpoint at its next step boundary and exit 0 within --preempt-grace-s; then
hp-run exits 75 (EX_TEMPFAIL) so that a requeueing scheduler requeues the job.
Ranks still running after the grace get SIGTERM, then SIGKILL. A second signal
kills them at once.

exit status: 0 if every rank succeeded; 75 after a preemption the ranks stopped
for; else the last attempt's first failing rank's exit code (128+signal if it was
killed); 124 on timeout; 128+signal if hp-run was interrupted; 2 on a usage
error.)";

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
  if (opts.master_port > 0 && static_cast<long long>(opts.master_port) + opts.max_restarts > 65535) {
    throw UsageError("--master-port " + std::to_string(opts.master_port) + " + --max-restarts " +
                     std::to_string(opts.max_restarts) + " exceeds 65535 (attempt k uses port + k)");
  }
  if (static_cast<long long>(opts.nnodes) * opts.nproc_per_node > kIntMax) {
    throw UsageError("--nnodes * --nproc-per-node is too large");
  }
}

// How long the job may run, and what happens when a rank fails or a stop is asked for.
void add_job_options(CLI::App& app, Options& opts) {
  const auto seconds = integer_in(0, kIntMax, "a non-negative integer (seconds)");
  app.add_option("--timeout", opts.timeout_s,
                 "kill all ranks after S seconds, every restart included; 0 = never")
      ->capture_default_str()
      ->check(seconds);
  app.add_option("--grace", opts.grace_s, "seconds between SIGTERM and SIGKILL")
      ->capture_default_str()
      ->check(seconds);
  app.add_option("--max-restarts", opts.max_restarts,
                 "restart every rank up to N times after a failure (a rank's non-zero exit or signal, or a "
                 "stuck rank)")
      ->capture_default_str()
      ->check(integer_in(0, kIntMax, "a non-negative integer"));
  app.add_option("--restart-backoff-s", opts.restart_backoff_s, "seconds between a failure and the restart")
      ->capture_default_str()
      ->check(seconds);
  app.add_option("--preempt-grace-s", opts.preempt_grace_s,
                 "on SIGTERM or SIGINT: seconds the ranks get (after SIGUSR1) to checkpoint and stop")
      ->capture_default_str()
      ->check(seconds);
}

}  // namespace

// hp-run's own flags come before "--"; everything after it is the program and its arguments,
// passed on untouched (they may look like flags).
Options parse_args(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  const auto separator = std::find(args.begin(), args.end(), "--");
  Options opts;
  CLI::App app(kDescription, "hp-run");
  app.footer(kFooter);
  app.allow_extras();  // reported below in hp-run's own words
  app.add_option("--nproc-per-node", opts.nproc_per_node, "processes (ranks) to start on this node")
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
  add_job_options(app, opts);
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

}  // namespace hp_run
