#pragma once
// What the benchmarks share: the slowest rank's statistics of timed calls, interleaved variants,
// the neighbour stream that measures the link, and the link's name and rate command.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/process_group.h>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class AdamW;
}

namespace bench {

/// Bytes of this rank's model state: every parameter, its gradient and its AdamW moments, counted
/// from their storages (a sharded parameter counts its shard).
double model_state_bytes(const torch::nn::Module& model, const std::vector<torch::optim::AdamW*>& optimizers);

/// Keep freed buffers in the heap, as a caching allocator would: otherwise every large
/// allocation is a fresh mmap whose page faults get timed (they can cost more than a transfer).
void keep_freed_memory();

/// User + system CPU seconds this process (all its threads) has used so far.
double process_cpu_seconds();

/// Median and spread (min, max) in seconds; each is the slowest rank's.
struct Stats {
  double median = 0, min = 0, max = 0;
};

/// The slowest rank's median, min and max of this rank's `seconds`. Collective over `group`.
Stats slowest(std::vector<double> seconds, const hyper_parallel::comm::Group& group);

/// Seconds of one call of `fn`: one warm-up, then `iters` calls each started together (a
/// barrier); the slowest rank's statistics. Collective.
Stats time_calls(const hyper_parallel::comm::Group& group, int iters, const std::function<void()>& fn);

/// Times several variants interleaved (A B C A B C ...), so that drifts of a shared machine hit
/// them alike: one warm-up round, then `iters` rounds, each call started together (a barrier).
/// Collective.
std::vector<Stats> interleaved(const hyper_parallel::comm::Group& group, int iters,
                               const std::vector<std::function<void()>>& variants);

/// The link, measured with the messages of the op under test: `messages` messages of `elems`
/// bfloat16 elements to the next rank of the group while as many arrive from the previous one.
///
/// Usage:
///   bench::NeighbourStream stream(group, /*messages=*/16, /*elems=*/1 << 19);
///   auto stats = bench::time_calls(group, 5, [&] { stream.run(); });
///   double bytes_per_s = stream.bytes() / stats.median;
class NeighbourStream {
 public:
  NeighbourStream(const hyper_parallel::comm::Group& group, int64_t messages, int64_t elems);
  /// Sends and receives every message, then returns. Collective over the group.
  void run() const;
  /// Bytes this rank sends per run.
  int64_t bytes() const { return messages_ * elems_ * 2; }

 private:
  hyper_parallel::comm::Group group_;
  int64_t messages_, elems_;
  at::Tensor out_;
  std::vector<at::Tensor> in_;
};

/// What the ranks talk over, as the launching script says (HP_BENCH_LINK), else loopback.
std::string link_name();
/// The command that changes this rank's link rate (HP_BENCH_RATE_CMD, set by run_bench.sh when
/// the ranks run in rate-limited network namespaces), or empty.
std::string rate_command();
/// Runs `command rate` on every rank (e.g. "250mbit"), then a barrier; `program` names the caller
/// in the error if the command fails.
void set_rate(const char* program, const std::string& command, const std::string& rate,
              const hyper_parallel::comm::Group& group);

}  // namespace bench
