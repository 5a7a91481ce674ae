// Bus bandwidth of the ring collectives next to raw point-to-point bandwidth, measured side by
// side in one run.
//   hp-run --nproc-per-node 2 -- build/bench/bench_comm [--max-mb 64] [--iters 5]
//
// P2P is one ring step: every rank sends a message to the next rank while receiving one from the
// previous, so it is exactly what each step of the rings moves. Bus bandwidth (as nccl-tests
// defines it) = (P-1)/P * total bytes / time, comparable with the P2P figure for the same
// per-step message size.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm.h>

#include "bench_util.h"

namespace hp = hyper_parallel;


int main(int argc, char** argv) {
  int64_t max_mb = 64;
  int iters = 5;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--max-mb" && i + 1 < argc) max_mb = std::stoll(argv[++i]);
    else if (a == "--iters" && i + 1 < argc) iters = std::stoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: bench_comm [--max-mb N] [--iters N]\n");
      return 2;
    }
  }
  bench::keep_freed_memory();
  hp::comm::init_process_group();
  auto group = hp::comm::world();
  const int64_t p = group.size(), r = group.rank();
  if (p < 2) {
    std::fprintf(stderr, "bench_comm: needs at least 2 ranks (hp-run --nproc-per-node 2)\n");
    return 2;
  }
  if (r == 0) {
    std::printf("ring collectives vs P2P, %lld ranks, fp32, median of %d (link: %s)\n",
                static_cast<long long>(p), iters,
                bench::link_name().c_str());
    std::printf("%10s %12s %12s %12s %12s %8s %8s\n", "total MB", "p2p GB/s", "ag busGB/s",
                "rs busGB/s", "ar busGB/s", "ag/p2p", "rs/p2p");
  }
  for (int64_t bytes = int64_t{1} << 16; bytes <= (max_mb << 20); bytes *= 4) {
    const int64_t numel = bytes / 4, step_numel = numel / p;
    auto chunk = at::randn({step_numel});
    auto incoming = at::empty({step_numel});
    auto full = at::randn({step_numel * p});
    const auto next = (r + 1) % p, prev = (r + p - 1) % p;
    double t_p2p = bench::median_seconds(group, iters, [&] {
      auto tags = hp::comm::reserve_tags(group);
      auto s = hp::comm::isend(chunk, next, group, tags.step(0));
      auto rv = hp::comm::irecv(incoming, prev, group, tags.step(0));
      rv.wait();
      s.wait();
    });
    double t_ag = bench::median_seconds(group, iters, [&] { hp::comm::all_gather(chunk, 0, group); });
    double t_rs = bench::median_seconds(group, iters, [&] {
      hp::comm::reduce_scatter(full, 0, hp::comm::ReduceOp::kSum, group);
    });
    double t_ar = bench::median_seconds(group, iters, [&] {
      hp::comm::all_reduce(full, hp::comm::ReduceOp::kSum, group);
    });
    const double step_bytes = 4.0 * step_numel, total = step_bytes * p;
    const double p2p = step_bytes / t_p2p / 1e9;
    const double ag = (p - 1.0) / p * total / t_ag / 1e9;
    const double rs = (p - 1.0) / p * total / t_rs / 1e9;
    const double ar = 2.0 * (p - 1.0) / p * total / t_ar / 1e9;
    if (r == 0) {
      std::printf("%10.3f %12.3f %12.3f %12.3f %12.3f %7.0f%% %7.0f%%\n", total / (1 << 20), p2p,
                  ag, rs, ar, 100 * ag / p2p, 100 * rs / p2p);
    }
  }
  hp::comm::destroy_process_group();
  return 0;
}
