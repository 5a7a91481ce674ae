// MC2 overlap, measured side by side in one run on the same ranks, shapes and ring:
//   compute   the op's matmuls alone (same chunks, no communication)
//   comm      the op's ring alone: same transfers, chunks and schedule, matmuls left out
//   unfused   collective then matmul (AG+MM) / matmul then collective (MM+RS)
//   fused     the MC2 op, for each chunks_per_rank
//   speedup = unfused / fused, efficiency = max(compute, comm) / fused (1.0 = perfect overlap)
//
//   hp-run --nproc-per-node 2 -- build/bench/bench_mc2            (loopback)
//   bash bench/run_bench.sh bench_mc2                               (loopback and a veth link)
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm.h>
#include <hyper_parallel/core/tensor_parallel/mc2.h>

#include "bench_util.h"

namespace hp = hyper_parallel;
namespace tp = hp::tensor_parallel;

namespace {

struct Shape {
  const char* name;
  int64_t rows_per_rank, k, n;  // AG+MM: x [rows, k] gathered, w [n, k]. MM+RS: x [P rows, k], w [n, k].
};

struct Timing {
  int64_t chunks;
  double fused, comm;  // the fused op, and its ring alone, at this chunk count
};

// One line per op and shape; speedup and efficiency for the chunk count that ran fastest.
void report(const char* op, const Shape& s, double compute, double unfused,
            const std::vector<Timing>& timings) {
  const Timing* best = &timings.front();
  for (const auto& t : timings) {
    if (t.fused < best->fused) best = &t;
  }
  std::printf("%-22s %-8s %9.1f %9.1f %9.1f", op, s.name, compute * 1e3, best->comm * 1e3,
              unfused * 1e3);
  for (const auto& t : timings) std::printf(" %9.1f", t.fused * 1e3);
  std::printf("   %5.2fx   %5.2f   (chunks %lld)\n", unfused / best->fused,
              std::max(compute, best->comm) / best->fused, static_cast<long long>(best->chunks));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 5;
  std::vector<int64_t> chunk_counts{1, 2, 4};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--iters" && i + 1 < argc) {
      iters = std::stoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: bench_mc2 [--iters N]\n");
      return 2;
    }
  }
  bench::keep_freed_memory();
  hp::comm::init_process_group();
  auto group = hp::comm::world();
  const int64_t p = group.size();
  if (p < 2) {
    std::fprintf(stderr, "bench_mc2: needs at least 2 ranks (hp-run --nproc-per-node 2)\n");
    return 2;
  }
  const bool print = group.rank() == 0;
  // "ffn": the bench Llama preset's w1 at TP 2, batch 8 (1024 rows per rank, dim 1024, 1408 outputs).
  const Shape shapes[] = {{"ffn", 1024, 1024, 1408}, {"small", 512, 2048, 1024}, {"medium", 1024, 4096, 1792}};
  if (print) {
    std::printf("MC2 overlap, %lld ranks, bf16, median of %d, link: %s\n", static_cast<long long>(p),
                iters, bench::link_name().c_str());
    std::printf("%-22s %-8s %9s %9s %9s", "op", "shape", "compute", "comm", "unfused");
    for (auto c : chunk_counts) std::printf("  fused/c%lld", static_cast<long long>(c));
    std::printf("   speedup  effic.\n");
    std::printf("%-22s %-8s %9s %9s %9s\n", "", "", "ms", "ms", "ms");
  }
  for (const auto& s : shapes) {
    at::manual_seed(1 + group.rank());
    auto w = at::randn({s.n, s.k}).to(at::kBFloat16);
    {
      // AG+MM: gather x [rows, k] from every rank, multiply by wᵀ.
      auto x = at::randn({s.rows_per_rank, s.k}).to(at::kBFloat16);
      auto gathered = at::randn({p * s.rows_per_rank, s.k}).to(at::kBFloat16);
      double compute = bench::median_seconds(group, iters, [&] { at::mm(gathered, w.t()); });
      double unfused = bench::median_seconds(group, iters, [&] {
        at::mm(hp::comm::all_gather(x, 0, group), w.t());
      });
      std::vector<Timing> timings;
      for (auto c : chunk_counts) {
        const auto opts = tp::MC2Options().chunks_per_rank(c);
        timings.push_back(
            {c, bench::median_seconds(group, iters, [&] { tp::all_gather_matmul(x, w, group, opts); }),
             bench::median_seconds(group, iters, [&] {
               tp::detail::all_gather_matmul_transfers_only(x, w, group, opts);
             })});
      }
      if (print) report("all_gather_matmul", s, compute, unfused, timings);
    }
    {
      // MM+RS: x [P rows, k] times wᵀ, reduce-scatter the rows (fp32 accumulators travel).
      auto x = at::randn({p * s.rows_per_rank, s.k}).to(at::kBFloat16);
      double compute = bench::median_seconds(group, iters, [&] { at::mm(x, w.t()); });
      double unfused = bench::median_seconds(group, iters, [&] {
        hp::comm::reduce_scatter(at::mm(x, w.t()), 0, hp::comm::ReduceOp::kSum, group);
      });
      std::vector<Timing> timings;
      for (auto c : chunk_counts) {
        const auto opts = tp::MC2Options().chunks_per_rank(c);
        timings.push_back(
            {c, bench::median_seconds(group, iters, [&] { tp::matmul_reduce_scatter(x, w, group, opts); }),
             bench::median_seconds(group, iters, [&] {
               tp::detail::matmul_reduce_scatter_transfers_only(x, w, group, opts);
             })});
      }
      if (print) report("matmul_reduce_scatter", s, compute, unfused, timings);
    }
  }
  hp::comm::destroy_process_group();
  return 0;
}
