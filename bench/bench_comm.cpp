// Bus bandwidth of the ring collectives next to raw point-to-point bandwidth, measured side by
// side in one run.
//   hp-run --nproc-per-node 2 -- build/bench/bench_comm [--max-mb 64] [--iters 5]
//
// P2P is one ring step: every rank sends a message to the next rank while receiving one from the
// previous, so it is exactly what each step of the rings moves. Bus bandwidth (as nccl-tests
// defines it) = (P-1)/P * total bytes / time, comparable with the P2P figure for the same
// per-step message size.
#include <cstdio>
#include <vector>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include <hyper_parallel/core/comm.h>

#include "bench_util.h"
#include "common/run_main.h"

namespace hp = hyper_parallel;

namespace {

// Bandwidths in GB/s for one total size.
struct Row {
  double total_mb, p2p, all_gather, reduce_scatter, all_reduce;
};

Row measure(const hp::comm::Group& group, int64_t bytes, int iters) {
  const int64_t p = group.size(), step_numel = bytes / 4 / p;
  auto chunk = at::randn({step_numel});
  auto full = at::randn({step_numel * p});
  const bench::NeighbourStream step(group, 1, 2 * step_numel);  // one fp32 ring step's bytes
  const auto stats =
      bench::interleaved(group, iters,
                         {[&] { step.run(); }, [&] { hp::comm::all_gather(chunk, 0, group); },
                          [&] { hp::comm::reduce_scatter(full, 0, hp::comm::ReduceOp::kSum, group); },
                          [&] { hp::comm::all_reduce(full, hp::comm::ReduceOp::kSum, group); }});
  const double step_bytes = 4.0 * step_numel, total = step_bytes * p, bus = (p - 1.0) / p * total;
  return {total / (1 << 20), step_bytes / stats[0].median / 1e9, bus / stats[1].median / 1e9,
          bus / stats[2].median / 1e9, 2 * bus / stats[3].median / 1e9};
}

void report(const Row& row) {
  std::printf("%10.3f %12.3f %12.3f %12.3f %12.3f %7.0f%% %7.0f%%\n", row.total_mb, row.p2p, row.all_gather,
              row.reduce_scatter, row.all_reduce, 100 * row.all_gather / row.p2p,
              100 * row.reduce_scatter / row.p2p);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t max_mb = 64;
  int iters = 5;
  CLI::App app("Ring collectives' bus bandwidth next to point-to-point bandwidth.", "bench_comm");
  app.add_option("--max-mb", max_mb, "largest total size")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--iters", iters, "rounds per variant (median)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  return hp_examples::run_main("bench_comm", [&] {
    bench::keep_freed_memory();
    hp::comm::init_process_group();
    auto group = hp::comm::world();
    TORCH_CHECK(group.size() >= 2, "bench_comm: expected at least 2 ranks (hp-run --nproc-per-node 2), got ",
                group.size());
    const bool print = group.rank() == 0;
    if (print) {
      std::printf("ring collectives vs P2P, %lld ranks, fp32, median of %d (interleaved), link: %s\n",
                  static_cast<long long>(group.size()), iters, bench::link_name().c_str());
      std::printf("%10s %12s %12s %12s %12s %8s %8s\n", "total MB", "p2p GB/s", "ag busGB/s", "rs busGB/s",
                  "ar busGB/s", "ag/p2p", "rs/p2p");
    }
    for (int64_t bytes = int64_t{1} << 16; bytes <= (max_mb << 20); bytes *= 4) {
      const auto row = measure(group, bytes, iters);
      if (print) report(row);
    }
    hp::comm::destroy_process_group();
    return 0;
  });
}
