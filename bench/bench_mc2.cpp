// MC2 overlap against the physical bound, measured side by side in one run (variants
// interleaved, median and spread of --iters rounds) on the same ranks and shapes:
//   stream     the link: this rank streams the op's minimum bytes to the next rank in the op's
//              chunk-sized messages while receiving as much (T_comm_min; rate = bytes / time)
//   compute    the op's matmuls alone, in the same chunks, no communication (T_compute)
//   unfused    the library's collective, then the matmul (AG+MM) / the matmul, then the
//              collective (MM+RS)
//   fused      the MC2 op, for each chunks_per_rank, and with chunks_per_rank = auto (the
//              default: a cost model's choice per op; the count it chose is printed)
//   coll       the library's collective alone; engine: the fused op's own schedule with no-op
//              callbacks (same transfers as fused)
// bytes_min per rank, 16-bit: all-gather (P-1)·m·k·2; reduce-scatter (P-1)/P·M·n·2.
// T_bound = max(T_compute, T_comm_min); efficiency = T_bound / T_fused; speedup =
// T_unfused / T_fused; r = T_comm_min / T_compute.
//
//   bash bench/run_bench.sh bench_mc2 2gbit 2 -- --iters 7           (loopback, then the link)
//   bash bench/run_bench.sh bench_mc2 2gbit 2 -- --sweep --csv sweep.csv   (rates so that r
//        spans 0.25..4 for every op and shape; bench/plot_sweep.sh draws the CSV)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include <hyper_parallel/core/comm.h>
#include <hyper_parallel/core/tensor_parallel/mc2/ops.h>

#include "bench_util.h"
#include "common/run_main.h"

// The fused ops' schedules without their matmuls (an internal bench hook), and the count the
// automatic choice proposes on this rank (rank 0's is the one all ranks use).
#include "core/tensor_parallel/mc2/chunk_planner.h"
#include "core/tensor_parallel/mc2/transfers_only.h"

namespace hp = hyper_parallel;
namespace tp = hp::tensor_parallel;

namespace {

struct Shape {
  std::string name;
  int64_t rows_per_rank, k, n;  // AG+MM: x [rows, k] gathered, w [n, k]. MM+RS: x [P rows, k].
};

enum class Op { kAllGatherMatmul, kMatmulReduceScatter };
const char* op_name(Op op) {
  return op == Op::kAllGatherMatmul ? "all_gather_matmul" : "matmul_reduce_scatter";
}

struct Result {
  double rate_gbps = 0, r = 0;
  bench::Stats stream, compute, unfused, coll, engine;
  double compute_whole = 0;      // the same matmuls as one GEMM per block (no chunking)
  double compute_contended = 0;  // compute while the engine's transfers run on the same cores
  std::vector<std::pair<int64_t, bench::Stats>> fused;  // per chunk count
  bench::Stats fused_auto;                              // chunks_per_rank = auto
  int64_t auto_chunks = 0;                              // what it chose
};

// The operands of one op on one shape, and its variants as callables.
struct Setup {
  bool ag;
  int64_t p, m;
  at::Tensor w, x, full, y;
  std::unique_ptr<bench::NeighbourStream> stream;
  tp::MC2Options default_options;

  Setup(Op op, const Shape& s, const hp::comm::Group& group, int64_t stream_chunks)
      : ag(op == Op::kAllGatherMatmul), p(group.size()), m(s.rows_per_rank) {
    at::manual_seed(1 + group.rank());
    w = at::randn({s.n, s.k}).to(at::kBFloat16);
    x = at::randn({ag ? m : p * m, s.k}).to(at::kBFloat16);
    full = at::randn({p * m, s.k}).to(at::kBFloat16);  // AG: stands for the gathered rows
    y = at::empty({p * m, s.n}, at::kBFloat16);
    // The stream: bytes_min per rank, in the messages of one chunk of the fused op.
    const int64_t width = ag ? s.k : s.n, bytes_min = (p - 1) * m * width * 2;
    const int64_t message_elems = std::max<int64_t>(1, m / stream_chunks) * width;
    stream = std::make_unique<bench::NeighbourStream>(
        group, std::max<int64_t>(1, bytes_min / (message_elems * 2)), message_elems);
    default_options = tp::MC2Options().chunks_per_rank(stream_chunks);
  }

  // The op's matmuls in `chunks` chunks per block.
  void matmuls(int64_t chunks) {
    const auto& a = ag ? full : x;
    for (int64_t b = 0; b < p; ++b) {
      for (int64_t j = 0; j < chunks; ++j) {
        const int64_t rows = hp::comm::chunk_size(m, chunks, j);
        const int64_t at_row = b * m + hp::comm::chunk_offset(m, chunks, j);
        auto out = y.narrow(0, at_row, rows);
        at::mm_out(out, a.narrow(0, at_row, rows), w.t());
      }
    }
  }
  void unfused(const hp::comm::Group& group) {
    if (ag) {
      at::mm(hp::comm::all_gather(x, 0, group), w.t());
    } else {
      hp::comm::reduce_scatter(at::mm(x, w.t()), 0, hp::comm::ReduceOp::kSum, group);
    }
  }
  void collective(const hp::comm::Group& group) {
    if (ag) {
      hp::comm::all_gather(x, 0, group);
    } else {
      hp::comm::reduce_scatter(y, 0, hp::comm::ReduceOp::kSum, group);
    }
  }
  // The fused op's own schedule with no-op callbacks: the transfers it has to hide.
  void engine(const hp::comm::Group& group) {
    if (ag) {
      tp::detail::all_gather_matmul_transfers_only(x, w, group, default_options);
    } else {
      tp::detail::matmul_reduce_scatter_transfers_only(x, w, group, default_options);
    }
  }
  int64_t auto_chunks(const hp::comm::Group& group) const {
    return ag ? tp::detail::all_gather_mm_chunks(x, w.t(), group, tp::MC2Options())
              : tp::detail::mm_reduce_scatter_chunks(x, w.t(), group, tp::MC2Options());
  }
  void fused(const hp::comm::Group& group, const tp::MC2Options& options) {
    if (ag) {
      tp::all_gather_matmul(x, w, group, options);
    } else {
      tp::matmul_reduce_scatter(x, w, group, options);
    }
  }
};

// Seconds of `fn` alone, appended to `times` (for variants timed inside another variant).
template <typename Fn>
void timed(std::vector<double>& times, Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

// One op on one shape at the current link rate.
Result measure(Op op, const Shape& s, const hp::comm::Group& group, int iters,
               const std::vector<int64_t>& chunk_counts, int64_t stream_chunks) {
  Setup u(op, s, group, stream_chunks);
  // For the gap breakdown: the same matmuls unchunked, and the chunked ones while the fused
  // op's transfers run in another thread of this process (as they do inside the fused op).
  std::vector<double> whole_times, contended_times;
  std::vector<std::function<void()>> variants{[&] { u.stream->run(); },
                                              [&] { u.matmuls(stream_chunks); },
                                              [&] { u.unfused(group); },
                                              [&] { u.collective(group); },
                                              [&] { u.engine(group); },
                                              [&] { timed(whole_times, [&] { u.matmuls(1); }); },
                                              [&] {
                                                std::thread transfers([&] { u.engine(group); });
                                                timed(contended_times, [&] { u.matmuls(stream_chunks); });
                                                transfers.join();
                                              }};
  for (auto c : chunk_counts) {
    variants.push_back(
        [&u, &group, options = tp::MC2Options().chunks_per_rank(c)] { u.fused(group, options); });
  }
  variants.push_back([&u, &group] { u.fused(group, tp::MC2Options()); });
  const auto stats = bench::interleaved(group, iters, variants);
  Result res{0,        0, stats[0], stats[1], stats[2],     stats[3],
             stats[4], 0, 0,        {},       stats.back(), u.auto_chunks(group)};
  for (size_t i = 0; i < chunk_counts.size(); ++i) res.fused.emplace_back(chunk_counts[i], stats[7 + i]);
  whole_times.erase(whole_times.begin());  // the warm-up round
  contended_times.erase(contended_times.begin());
  res.compute_whole = bench::slowest(whole_times, group).median;
  res.compute_contended = bench::slowest(contended_times, group).median;
  res.rate_gbps = 8.0 * u.stream->bytes() / res.stream.median / 1e9;
  res.r = res.stream.median / res.compute.median;
  return res;
}

// The run of a fixed count, or nullptr when that count was not measured.
const bench::Stats* fixed_count(const Result& res, int64_t chunks) {
  for (const auto& f : res.fused) {
    if (f.first == chunks) return &f.second;
  }
  return nullptr;
}

// The default of fixed counts, 2 chunks, against auto ("-" when 2 was not measured).
std::string c2_over_auto(const Result& res) {
  const auto* two = fixed_count(res, 2);
  if (two == nullptr) return "-";
  char text[16];
  std::snprintf(text, sizeof text, "%.3f", two->median / res.fused_auto.median);
  return text;
}

// The fastest fixed count and its run (the first of equals).
const std::pair<int64_t, bench::Stats>& best_fixed(const Result& res) {
  const auto* best = &res.fused.front();
  for (const auto& f : res.fused) {
    if (f.second.median < best->second.median) best = &f;
  }
  return *best;
}

// Across rows: how close auto came to the best fixed count and to 2 chunks (the old default),
// by its own run and by the fixed run of the count it chose (the same schedule, timed as a
// variant of its own: the two differ by the noise of one median).
struct AutoSummary {
  int rows = 0, own_within_5 = 0, chosen_within_5 = 0, chosen_rows = 0, not_worse_than_c2 = 0, with_c2 = 0;
  double auto_total = 0, best_total = 0, c2_total = 0, auto_with_c2_total = 0;
  void add(const Result& res) {
    const double best = best_fixed(res).second.median;
    ++rows;
    own_within_5 += res.fused_auto.median <= 1.05 * best;
    auto_total += res.fused_auto.median;
    best_total += best;
    const auto* chosen = fixed_count(res, res.auto_chunks);
    if (chosen != nullptr) {
      ++chosen_rows;
      chosen_within_5 += chosen->median <= 1.05 * best;
    }
    if (const auto* two = fixed_count(res, 2)) {
      ++with_c2;
      const double mine = chosen != nullptr ? chosen->median : res.fused_auto.median;
      not_worse_than_c2 += mine <= 1.02 * two->median;  // within the noise of one median
      c2_total += two->median;
      auto_with_c2_total += res.fused_auto.median;
    }
  }
  void print() const {
    std::printf(
        "auto over %d rows: its own run within 5%% of the best fixed count in %d; the count it chose "
        "within 5%% in %d of %d, not slower than 2 chunks (2%% noise) in %d of %d\n",
        rows, own_within_5, chosen_within_5, chosen_rows, not_worse_than_c2, with_c2);
    std::printf("auto over %d rows, total time: best fixed per row / auto %.3f; 2 chunks / auto %.3f\n", rows,
                best_total / auto_total, auto_with_c2_total > 0 ? c2_total / auto_with_c2_total : 0.0);
  }
};

void print_header(const std::vector<int64_t>& chunk_counts) {
  std::printf("%-22s %-7s %6s %5s %9s %9s %9s %9s", "op", "shape", "Gbit/s", "r", "compute", "comm_min",
              "bound", "unfused");
  for (auto c : chunk_counts) std::printf("  fused/c%-2lld", static_cast<long long>(c));
  std::printf("  fused/auto %7s %7s %6s %9s %9s %5s %9s %11s %8s\n", "speedup", "effic.", "chunks", "coll",
              "engine", "auto", "best/auto", "best/chosen", "c2/auto");
  std::printf("%-22s %-7s %6s %5s %9s %9s %9s %9s\n", "", "", "", "", "ms", "ms", "ms", "ms");
}

// A median with its spread, as "12.3" (the spread goes to the CSV).
void print_line(Op op, const Shape& s, const Result& res) {
  const auto* best = &best_fixed(res);
  const double bound = std::max(res.compute.median, res.stream.median);
  std::printf("%-22s %-7s %6.2f %5.2f %9.1f %9.1f %9.1f %9.1f", op_name(op), s.name.c_str(), res.rate_gbps,
              res.r, res.compute.median * 1e3, res.stream.median * 1e3, bound * 1e3,
              res.unfused.median * 1e3);
  for (const auto& f : res.fused) std::printf(" %10.1f", f.second.median * 1e3);
  const auto* chosen = fixed_count(res, res.auto_chunks);
  char chosen_text[16] = "-";
  if (chosen != nullptr)
    std::snprintf(chosen_text, sizeof chosen_text, "%.3f", best->second.median / chosen->median);
  std::printf(" %11.1f %6.2fx %7.2f %6lld %9.1f %9.1f %5lld %9.3f %11s %8s\n", res.fused_auto.median * 1e3,
              res.unfused.median / best->second.median, bound / best->second.median,
              static_cast<long long>(best->first), res.coll.median * 1e3, res.engine.median * 1e3,
              static_cast<long long>(res.auto_chunks), best->second.median / res.fused_auto.median,
              chosen_text, c2_over_auto(res).c_str());
  // Where the time beyond the bound goes, in ms: the GEMMs cut in chunks run slower than whole
  // ones; the transfers' CPU work slows the compute on shared cores; the rest is exposed
  // communication (head, tail, waits).
  const double chunking = res.compute.median - res.compute_whole;
  const double contention = res.compute_contended - res.compute.median;
  std::printf(
      "%-22s %-7s   gap %.1f ms = chunked GEMMs %.1f + transfer CPU contention %.1f + exposed %.1f"
      "  (fused spread %.1f..%.1f)\n",
      "", "", (best->second.median - bound) * 1e3, chunking * 1e3, contention * 1e3,
      (best->second.median - bound - chunking - contention) * 1e3, best->second.min * 1e3,
      best->second.max * 1e3);
  std::fflush(stdout);
}

void write_csv(std::ofstream& csv, Op op, const Shape& s, const Result& res, const std::string& link) {
  auto cell = [&](const bench::Stats& st) {
    csv << "," << st.median * 1e3 << "," << st.min * 1e3 << "," << st.max * 1e3;
  };
  // The fixed counts, then auto as "auto:<the count it chose>".
  auto rows = res.fused;
  rows.emplace_back(-1, res.fused_auto);
  for (const auto& [chunks, fused] : rows) {
    std::string link_text = link;
    std::replace(link_text.begin(), link_text.end(), ',', ';');  // one CSV field
    const auto chunks_text = chunks < 0 ? "auto:" + std::to_string(res.auto_chunks) : std::to_string(chunks);
    csv << op_name(op) << "," << s.name << "," << s.rows_per_rank << "," << s.k << "," << s.n << ","
        << link_text << "," << res.rate_gbps << "," << res.r << "," << chunks_text;
    cell(res.compute);
    cell(res.stream);
    cell(res.unfused);
    cell(fused);
    const double bound = std::max(res.compute.median, res.stream.median);
    csv << "," << bound * 1e3 << "," << (res.compute.median + res.stream.median) * 1e3 << ","
        << res.unfused.median / fused.median << "," << bound / fused.median << "\n";
  }
  csv.flush();
}

// What main measures, and where it reports.
struct Run {
  int iters;
  std::vector<int64_t> chunk_counts;
  int64_t stream_chunks;
  std::vector<double> ratios;  // empty: the current rate only
  std::string rate_cmd;
  bool print;
  std::ofstream* csv;
  std::string link;
  AutoSummary summary{};

  void report(Op op, const Shape& s, const Result& res) {
    summary.add(res);
    if (print) print_line(op, s, res);
    if (csv != nullptr) write_csv(*csv, op, s, res, link);
  }

  // One op on one shape: at the current rate, or at each rate that makes r take each ratio.
  void op_on_shape(Op op, const Shape& s, const hp::comm::Group& group) {
    if (ratios.empty()) {
      report(op, s, measure(op, s, group, iters, chunk_counts, stream_chunks));
      return;
    }
    // T_compute does not depend on the link: measure it once, then set each rate so that
    // r = T_comm_min / T_compute takes the requested values.
    const int64_t m = s.rows_per_rank;
    const double bytes_min = (group.size() - 1) * m * (op == Op::kAllGatherMatmul ? s.k : s.n) * 2.0;
    auto probe = measure(op, s, group, 3, {stream_chunks}, stream_chunks);
    for (double ratio : ratios) {
      const double rate = std::clamp(8 * bytes_min / (ratio * probe.compute.median), 2e7, 4e10);
      bench::set_rate("bench_mc2", rate_cmd, std::to_string(static_cast<long long>(rate)) + "bit", group);
      hp::comm::probe_link(group);  // what auto reads: the link as it is now
      report(op, s, measure(op, s, group, iters, chunk_counts, stream_chunks));
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  int iters = 7;
  bool sweep = false;
  std::string csv_path;
  std::vector<int64_t> chunk_counts{1, 2, 4, 8};
  int64_t stream_chunks = 4;
  std::vector<double> ratios{0.25, 0.5, 1, 2, 4};
  CLI::App app("MC2 fused ops against their physical bound, side by side in one run.", "bench_mc2");
  app.add_option("--iters", iters, "rounds per variant (median and spread)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--chunks", chunk_counts, "chunks_per_rank values of the fused variants")
      ->capture_default_str();
  app.add_option("--stream-chunks", stream_chunks, "chunks of the stream, compute and engine variants")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_flag("--sweep", sweep, "set the link rate (HP_BENCH_RATE_CMD) so r takes each --ratios value");
  app.add_option("--ratios", ratios, "r = T_comm_min / T_compute values of the sweep")->capture_default_str();
  app.add_option("--csv", csv_path, "append one row per op, shape, rate and chunk count");
  CLI11_PARSE(app, argc, argv);

  return hp_examples::run_main("bench_mc2", [&] {
    bench::keep_freed_memory();
    hp::comm::init_process_group();
    auto group = hp::comm::world();
    const int64_t p = group.size();
    TORCH_CHECK(p >= 2, "bench_mc2: expected at least 2 ranks (hp-run --nproc-per-node 2), got ", p);
    const auto rate_cmd = bench::rate_command();
    const bool print = group.rank() == 0;
    if (sweep && rate_cmd.empty()) {
      // On loopback (or any link this program cannot shape) there is no rate to sweep.
      if (print) std::printf("bench_mc2: no HP_BENCH_RATE_CMD (loopback?): --sweep ignored\n");
      sweep = false;
    }
    std::ofstream csv;
    if (print && !csv_path.empty()) {
      const bool fresh = !std::ifstream(csv_path).good();
      csv.open(csv_path, std::ios::app);
      if (fresh) {
        csv << "op,shape,rows_per_rank,k,n,link,rate_gbps,r,chunks,compute_ms,compute_min,compute_max,"
               "comm_min_ms,comm_min_min,comm_min_max,unfused_ms,unfused_min,unfused_max,fused_ms,"
               "fused_min,fused_max,bound_ms,serial_ms,speedup,efficiency\n";
      }
    }
    // "ffn": the bench Llama preset's w1 at TP 2, batch 8 (1024 rows per rank, dim 1024, 1408
    // outputs); "small" and "medium" bracket it.
    const std::vector<Shape> shapes{
        {"ffn", 1024, 1024, 1408}, {"small", 512, 2048, 1024}, {"medium", 1024, 4096, 1792}};
    const auto link = bench::link_name();
    if (print) {
      std::printf("MC2 overlap, %lld ranks, bf16, median of %d (interleaved), link: %s\n",
                  static_cast<long long>(p), iters, link.c_str());
      print_header(chunk_counts);
    }
    Run run{iters,
            chunk_counts,
            stream_chunks,
            sweep ? ratios : std::vector<double>{},
            rate_cmd,
            print,
            csv.is_open() ? &csv : nullptr,
            link};
    for (const auto& s : shapes) {
      for (Op op : {Op::kAllGatherMatmul, Op::kMatmulReduceScatter}) run.op_on_shape(op, s, group);
    }
    auto& summary = run.summary;
    if (print) summary.print();
    hp::comm::destroy_process_group();
    return 0;
  });
}
