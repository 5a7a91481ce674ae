#include <hyper_parallel/core/comm/link_probe.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <limits>
#include <thread>
#include <vector>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm/op.h>
#include <hyper_parallel/core/comm/p2p.h>

#include "group_impl.h"
#include "test_hooks.h"
#include "transfer.h"

namespace hyper_parallel::comm {
namespace {

// Two sizes: the small one is mostly latency, the difference between them is mostly rate.
constexpr int64_t kSmallBytes = 4 << 10, kLargeBytes = 1 << 20;
constexpr int kRounds = 4;  // the first is a warm-up

// Keeps a core busy with matrix products for as long as it lives. The fused ops' transfers
// progress while the calling thread multiplies; on a transport that runs on the CPU, as TCP does,
// a message then waits for a core, and its cost is measured so.
class BusyMatmuls {
 public:
  BusyMatmuls()
      : a_(at::ones({256, 256})), thread_([this] {
          const at::NoGradGuard no_grad;
          while (!stop_) at::mm(a_, a_);
        }) {}
  ~BusyMatmuls() {
    stop_ = true;
    thread_.join();
  }
  BusyMatmuls(const BusyMatmuls&) = delete;
  BusyMatmuls& operator=(const BusyMatmuls&) = delete;

 private:
  at::Tensor a_;
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: starts once the members it reads exist
};

// Seconds of one ring round of `bytes` messages (send to next, receive from prev): the median of
// the timed rounds. Tags: round i of size index `size` is step 2 i + size of the block.
double ring_round_seconds(const Group& group, const OpTags& tags, int64_t bytes, int size) {
  const int64_t p = group.size(), r = group.rank();
  auto out = at::zeros({bytes}, at::kByte), in = at::empty({bytes}, at::kByte);
  std::vector<double> times;
  for (int i = 0; i < kRounds; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    // Not payload: neither counted nor traced as the program's transfers.
    auto recv = detail::post_transfer(false, in, (r + p - 1) % p, group, tags.step(2 * i + size), false);
    auto send = detail::post_transfer(true, out, (r + 1) % p, group, tags.step(2 * i + size), false);
    recv.wait();
    send.wait();
    if (i > 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

}  // namespace

LinkEstimate probe_link(const Group& group) {
  OpScope op(group, {CollectiveKind::kLinkProbe, at::kByte, {kSmallBytes, kLargeBytes, 0, 0}}, group.name(),
             /*counted=*/false);
  LinkEstimate link{std::numeric_limits<double>::infinity(), 0};
  // A compute-only twin (test_hooks.h) moves nothing: there is no link to measure, and keeping
  // its "infinitely fast" one would mislead every later op on the group.
  if (test_hooks::transfers_skipped()) return link;
  if (group.size() > 1) {
    const auto tags = reserve_tags(group);
    const BusyMatmuls busy;
    const double small = ring_round_seconds(group, tags, kSmallBytes, 0);
    const double large = ring_round_seconds(group, tags, kLargeBytes, 1);
    // A link faster than this clock can tell apart is taken as the large message's own rate.
    const double extra = large - small;
    link.bytes_per_s = extra > 0 ? (kLargeBytes - kSmallBytes) / extra : kLargeBytes / large;
    link.latency_s = std::max(0.0, small - kSmallBytes / link.bytes_per_s);
  }
  auto& impl = group.impl();
  const std::lock_guard<std::mutex> lock(impl.link_mutex);
  impl.link = link;
  return link;
}

LinkEstimate link_estimate(const Group& group) {
  {
    auto& impl = group.impl();
    const std::lock_guard<std::mutex> lock(impl.link_mutex);
    if (impl.link) return *impl.link;
  }
  return probe_link(group);
}

}  // namespace hyper_parallel::comm
