#include "chunk_planner.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <set>
#include <sstream>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm/chunks.h>
#include <hyper_parallel/core/comm/link_probe.h>
#include <hyper_parallel/core/comm/p2p.h>
#include <hyper_parallel/core/comm/schedule.h>
#include <hyper_parallel/core/nn/matmul.h>

namespace hyper_parallel::tensor_parallel::detail {
namespace {

// Seconds of one [rows, k] @ [k, n] product of `dtype` on this rank, by shape: the process's
// only cache of timings, filled by the first op of each shape (docs/architecture.md, global state).
class GemmTimes {
 public:
  static GemmTimes& get() {
    static GemmTimes times;
    return times;
  }

  // `repeats` products per timed sample: a chunk count's worth, so that every candidate times a
  // whole block and short products average out their noise.
  double seconds(const at::Tensor& a, const at::Tensor& b, int64_t rows, int64_t repeats) {
    const Key key{a.scalar_type(), rows, a.size(1), b.size(1)};
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      const auto it = seconds_.find(key);
      if (it != seconds_.end()) return it->second;
    }
    const double measured = measure(a.narrow(0, 0, rows), b, repeats);
    const std::lock_guard<std::mutex> lock(mutex_);
    return seconds_.emplace(key, measured).first->second;
  }

 private:
  using Key = std::tuple<at::ScalarType, int64_t, int64_t, int64_t>;

  // Per product, the fastest of two samples of `repeats` products after a warm-up (which also
  // lets a JIT-compiled kernel for this shape be built outside the timing).
  static double measure(const at::Tensor& a, const at::Tensor& b, int64_t repeats) {
    const at::NoGradGuard no_grad;
    nn::mm(a, b);
    double best = 0;
    for (int i = 0; i < 2; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t j = 0; j < repeats; ++j) nn::mm(a, b);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = i == 0 ? s : std::min(best, s);
    }
    return best / static_cast<double>(repeats);
  }

  std::mutex mutex_;
  std::map<Key, double> seconds_;
};

const char* schedule_name(FusedSchedule s) {
  switch (s) {
    case FusedSchedule::kRingGather:
      return "ring all-gather";
    case FusedSchedule::kRingReduce:
      return "ring reduce-scatter";
    case FusedSchedule::kDirectReduce:
      return "direct reduce-scatter";
  }
  return "?";
}

// HP_MC2_DEBUG: the model's inputs and predictions, once per schedule, shape and link estimate.
void maybe_print(FusedSchedule schedule, const at::Tensor& a, const at::Tensor& b, int64_t ranks,
                 const std::vector<ChunkCandidate>& candidates, const comm::LinkEstimate& link,
                 int64_t chosen) {
  static const bool debug = std::getenv("HP_MC2_DEBUG") != nullptr;
  static std::mutex mutex;
  static std::set<std::tuple<int, int64_t, int64_t, int64_t, double, double>> printed;
  if (!debug) return;
  const std::lock_guard<std::mutex> lock(mutex);
  if (!printed
           .emplace(static_cast<int>(schedule), a.size(0), a.size(1), b.size(1), link.bytes_per_s,
                    link.latency_s)
           .second) {
    return;
  }
  std::ostringstream s;
  s << "hyper_parallel MC2 auto chunks: " << schedule_name(schedule) << " of [" << a.size(0) << ", "
    << a.size(1) << "] @ [" << b.size(0) << ", " << b.size(1) << "] on " << ranks << " ranks, link "
    << link.bytes_per_s * 8 / 1e9 << " Gbit/s + " << link.latency_s * 1e6 << " us per message:";
  for (const auto& c : candidates) {
    s << " c" << c.chunks << " (GEMM " << c.gemm_seconds * 1e3 << " ms) "
      << predicted_seconds(schedule, ranks, c, link) * 1e3 << " ms;";
  }
  s << " proposes " << chosen << "\n";
  std::cerr << s.str() << std::flush;
}

// a [rows, k] @ b [k, n] is the op's product; each chunk of `rows_per_rank` rows travels as
// `wire_dtype` (the gather's input rows; the reduce-scatter's partials, of width n).
int64_t proposed_chunks(FusedSchedule schedule, const at::Tensor& a, const at::Tensor& b,
                        int64_t rows_per_rank, at::ScalarType wire_dtype, const comm::Group& group,
                        const MC2Options& options) {
  if (options.chunks_per_rank() != MC2Options::kAutoChunks) return options.chunks_per_rank();
  // One rank, or no rows: nothing travels, one chunk.
  if (group.size() == 1 || rows_per_rank == 0) return 1;
  // The engine caps the chunks of one op so that each transfer has a tag of its own.
  const int64_t most = std::max<int64_t>(1, comm::OpTags::kMaxSteps / group.size());
  const auto link = comm::link_estimate(group);
  const int64_t width = schedule == FusedSchedule::kRingGather ? a.size(1) : b.size(1);
  const double row_bytes = static_cast<double>(width * c10::elementSize(wire_dtype));
  std::vector<ChunkCandidate> candidates;
  for (const int64_t c : candidate_chunk_counts(rows_per_rank)) {
    if (c > most) break;
    const int64_t rows = comm::chunk_size(rows_per_rank, c, 0);  // the largest chunk
    candidates.push_back({c, GemmTimes::get().seconds(a, b, rows, c), static_cast<double>(rows) * row_bytes});
  }
  const int64_t chosen = choose_chunks(schedule, group.size(), candidates, link);
  maybe_print(schedule, a, b, group.size(), candidates, link, chosen);
  return chosen;
}

}  // namespace

int64_t all_gather_mm_chunks(const at::Tensor& a, const at::Tensor& b, const comm::Group& group,
                             const MC2Options& options) {
  return proposed_chunks(FusedSchedule::kRingGather, a, b, a.size(0), a.scalar_type(), group, options);
}

int64_t mm_reduce_scatter_chunks(const at::Tensor& a, const at::Tensor& b, const comm::Group& group,
                                 const MC2Options& options) {
  const bool direct = comm::reduces_directly(a.scalar_type());
  return proposed_chunks(direct ? FusedSchedule::kDirectReduce : FusedSchedule::kRingReduce, a, b,
                         a.size(0) / group.size(),
                         direct ? a.scalar_type() : comm::accumulate_type(a.scalar_type()), group, options);
}

}  // namespace hyper_parallel::tensor_parallel::detail
