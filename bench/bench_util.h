#pragma once
// Timing helpers shared by the benchmarks.

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm.h>

namespace bench {

/// Keep freed buffers in the heap, as a caching allocator would: otherwise every large
/// allocation is a fresh mmap whose page faults get timed (they can cost more than a transfer).
inline void keep_freed_memory() {
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

/// Seconds of one call of fn: median over `iters` (after one warm-up), each iteration started
/// together (barrier), the slowest rank's median.
template <typename Fn>
double median_seconds(const hyper_parallel::comm::Group& group, int iters, Fn&& fn) {
  fn();
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    hyper_parallel::comm::barrier(group);
    auto t0 = std::chrono::steady_clock::now();
    fn();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  auto med = at::full({1}, times[times.size() / 2], at::kDouble);
  return hyper_parallel::comm::all_gather(med, 0, group).max().item<double>();
}

/// Median and spread (min, max) of one variant, in seconds; each is the slowest rank's.
struct Stats {
  double median = 0, min = 0, max = 0;
};

/// Times several variants interleaved (A B C A B C ...), so that drifts of a shared machine hit
/// them alike: one warm-up round, then `iters` rounds, each call started together (barrier).
inline std::vector<Stats> interleaved(const hyper_parallel::comm::Group& group, int iters,
                                      const std::vector<std::function<void()>>& variants) {
  for (const auto& fn : variants) fn();
  std::vector<std::vector<double>> times(variants.size());
  for (int i = 0; i < iters; ++i) {
    for (size_t v = 0; v < variants.size(); ++v) {
      hyper_parallel::comm::barrier(group);
      auto t0 = std::chrono::steady_clock::now();
      variants[v]();
      times[v].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  std::vector<Stats> out;
  for (auto& t : times) {
    std::sort(t.begin(), t.end());
    auto local = at::tensor({t[t.size() / 2], t.front(), t.back()}, at::kDouble).unsqueeze(0);
    auto all = hyper_parallel::comm::all_gather(local, 0, group);  // [P, 3]
    auto slowest = std::get<0>(all.max(0));
    out.push_back({slowest[0].item<double>(), slowest[1].item<double>(), slowest[2].item<double>()});
  }
  return out;
}

/// What the ranks talk over, as the launching script says (HP_BENCH_LINK), else loopback.
inline std::string link_name() {
  const char* link = std::getenv("HP_BENCH_LINK");
  return link ? link : "loopback (TCP costs CPU on the same cores as the matmuls)";
}

/// The command that changes this rank's link rate (HP_BENCH_RATE_CMD, set by run_bench.sh when
/// the ranks run in rate-limited network namespaces), or empty.
inline std::string rate_command() {
  const char* cmd = std::getenv("HP_BENCH_RATE_CMD");
  return cmd ? cmd : "";
}

}  // namespace bench
