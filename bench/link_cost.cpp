#include "link_cost.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/nn/matmul.h>

#include "bench_util.h"

namespace bench {

namespace comm = hyper_parallel::comm;

double machine_busy_seconds() {
  std::ifstream stat("/proc/stat");
  std::string cpu;
  int64_t user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0;
  if (!(stat >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq) || cpu != "cpu") return -1;
  return static_cast<double>(user + nice + system + irq + softirq) /
         static_cast<double>(sysconf(_SC_CLK_TCK));
}

int64_t local_ranks() {
  const char* n = std::getenv("LOCAL_WORLD_SIZE");
  return n ? std::max<int64_t>(1, std::atoll(n)) : 1;
}

namespace {

// A thread that runs bf16 matmuls, counting them, until it is destroyed (however its owner's
// scope ends: a failed transfer throws, and a joinable thread must never be destroyed).
class MatmulThread {
 public:
  MatmulThread()
      : a_(at::randn({128, 1024}).to(at::kBFloat16)),
        b_(at::randn({1024, 1024}).to(at::kBFloat16)),
        thread_([this] {
          at::NoGradGuard no_grad;
          while (!stop_) {
            hyper_parallel::nn::mm(a_, b_);  // the models' product: float-accumulated on every CPU
            ++done_;
          }
        }) {}
  ~MatmulThread() {
    stop_ = true;
    thread_.join();
  }
  int64_t done() const { return done_; }

 private:
  at::Tensor a_, b_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> done_{0};
  std::thread thread_;  // last: starts once the members it reads exist
};

// Matmuls a thread completes while `fn` runs on the calling thread, and the seconds `fn` took.
std::pair<int64_t, double> matmuls_beside(const comm::Group& group, const std::function<void()>& fn) {
  const MatmulThread matmuls;
  comm::barrier(group);
  const int64_t before = matmuls.done();
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return {matmuls.done() - before, seconds};
}

}  // namespace

double compute_lost_seconds(const comm::Group& group, int iters, const std::function<void()>& transfers) {
  std::vector<double> lost;
  for (int i = 0; i <= iters; ++i) {
    const auto [beside, seconds] = matmuls_beside(group, transfers);
    const auto [alone, same_time] = matmuls_beside(
        group, [s = seconds] { std::this_thread::sleep_for(std::chrono::duration<double>(s)); });
    if (i == 0 || alone == 0) continue;  // a warm-up
    const double matmul_seconds = same_time / static_cast<double>(alone);
    lost.push_back(std::max(0.0, seconds - static_cast<double>(beside) * matmul_seconds));
  }
  if (lost.empty()) lost.push_back(0);
  return slowest(std::move(lost), group).median;
}

LinkCost measure_link(const comm::Group& group, int64_t bytes) {
  // Rank 0's byte count: the ranks' own can differ (a row-sparse embedding sends each rank's
  // rows), and every rank must stream as many messages.
  bytes = comm::broadcast(at::full({1}, bytes, at::kLong), 0, group).item<int64_t>();
  const int64_t elems = (int64_t{1} << 20) / 2;
  const NeighbourStream stream(group, bytes / (2 * elems), elems);
  const double cpu0 = process_cpu_seconds(), machine0 = machine_busy_seconds();
  const double seconds = time_calls(group, 3, [&] { stream.run(); }).median;
  const double cpu = process_cpu_seconds() - cpu0, machine1 = machine_busy_seconds();
  const double mb = static_cast<double>(stream.bytes()) / 1e6;
  const double machine_per_rank = (machine1 - machine0) / static_cast<double>(local_ranks());
  LinkCost link{stream.bytes() / seconds, cpu * 1e3 / (4 * mb),
                machine0 < 0 || machine1 < 0 ? -1 : machine_per_rank * 1e3 / (4 * mb)};
  // Streams of at least half a second, so that the matmuls counted beside them are many.
  const int repeats = static_cast<int>(std::ceil(0.5 / seconds));
  const auto streams = [&] {
    for (int i = 0; i < repeats; ++i) stream.run();
  };
  link.compute_lost_ms_per_mb = compute_lost_seconds(group, 3, streams) * 1e3 / (repeats * mb);
  return link;
}

}  // namespace bench
