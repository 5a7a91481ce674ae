#pragma once
// Timing helpers shared by the benchmarks.

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
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

/// What the ranks talk over, as the launching script says (HP_BENCH_LINK), else loopback.
inline std::string link_name() {
  const char* link = std::getenv("HP_BENCH_LINK");
  return link ? link : "loopback (TCP costs CPU on the same cores as the matmuls)";
}

}  // namespace bench
