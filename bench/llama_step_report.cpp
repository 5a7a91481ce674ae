#include "llama_step_report.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>

namespace llama_step {
namespace {

// Where each configuration's exposed communication is: rank 0's blocked time per step in each
// region (forward, backward, grad_sync, optimizer) and op, largest first within a region. A
// started all-reduce's wait counts where it is waited for.
void report_exposed_waits(const Bench& b, const std::vector<Measured>& results) {
  std::printf("exposed waits (rank 0, ms per step, time blocked on transfers; region: op ms, ...):\n");
  for (size_t c = 0; c < results.size(); ++c) {
    std::map<std::string, std::vector<std::pair<double, std::string>>> by_region;
    double total = 0;
    for (const auto& [key, seconds] : results[c].waits) {
      if (seconds * 1e3 < 0.05) continue;
      by_region[key.first].push_back({seconds * 1e3, key.second});
      total += seconds * 1e3;
    }
    std::printf("  %-17s %7.1f ms =", b.configs[c].name.c_str(), total);
    for (auto& [region, ops] : by_region) {
      std::sort(ops.rbegin(), ops.rend());
      std::printf(" %s:", region.c_str());
      for (const auto& [ms, op] : ops) std::printf(" %s %.1f", op.c_str(), ms);
      std::printf(";");
    }
    std::printf("\n");
  }
}

// What resharding after the forward costs: fully_shard's backward gathers every group again, so
// "FSDP" sends more than "FSDP keep" per step; its extra MB and the two step times' ratio.
void report_regather(const Bench& b, const std::vector<Measured>& results) {
  std::optional<size_t> resharded, kept;
  for (size_t c = 0; c < b.configs.size(); ++c) {
    if (b.configs[c].dp != GradientSync::kFullyShard || b.configs[c].split_root) continue;
    (b.configs[c].reshard_after_forward ? resharded : kept) = c;
  }
  if (!resharded || !kept) return;
  const auto& r = results[*resharded];
  const auto& k = results[*kept];
  std::printf(
      "%s's backward all-gathers again: %.2f MB sent per step vs %s's %.2f (+%.2f MB, %.2fx the bytes), "
      "step %.2fx %s's\n",
      b.configs[*resharded].name.c_str(), r.bytes / 1e6, b.configs[*kept].name.c_str(), k.bytes / 1e6,
      (r.bytes - k.bytes) / 1e6, k.bytes > 0 ? static_cast<double>(r.bytes) / k.bytes : 0.0,
      r.step.median / k.step.median, b.configs[*kept].name.c_str());
}

// A parameter's name, short: "layers.0.attention.wq.weight" -> "0.wq".
std::string short_name(std::string name) {
  for (const std::string cut : {"layers.", "attention.", "feed_forward.", ".weight"}) {
    for (auto at = name.find(cut); at != std::string::npos; at = name.find(cut)) name.erase(at, cut.size());
  }
  return name;
}

// The sum of `phase(compute, bytes)` over a step's phases: the forward, the backward and the
// optimizer phase. A steady schedule's optimizer phase starts the next step's gathers and does not
// wait for them: they travel during the next forward, so there the optimizer phase and the forward
// are one phase.
template <typename Phase>
double over_phases(const Measured& m, bool steady, const Phase& phase) {
  const double backward = phase(m.compute_backward, m.backward_bytes);
  if (steady) {
    return backward + phase(m.compute_optimizer + m.compute_forward, m.optimizer_bytes + m.forward_bytes);
  }
  return backward + phase(m.compute_forward, m.forward_bytes) + phase(m.compute_optimizer, m.optimizer_bytes);
}

}  // namespace

// Speedups are against the first configuration (plain TP, or DP blocking). The bound is max(compute-only
// step, bytes sent / measured link rate); the phase-wise bound adds max(compute, wire) of the forward, of
// the backward and of the optimizer phase (its bytes: early gathers, the clipping's norm); the floor is the
// phase-wise bound with each phase's compute lengthened by what its transfers cost the compute beside them
// (the link's compute lost per MB): what a schedule that keeps each phase's transfers in that phase can at
// best expect on these cores. In a steady configuration the optimizer phase and the next forward count as
// one phase (over_phases).
void report(const Bench& b, const std::vector<Measured>& results, const std::string& preset,
            const std::string& rate, const bench::LinkCost& link, const Meshes& meshes) {
  const double rate_bytes = link.bytes_per_s, lost_per_byte = link.compute_lost_ms_per_mb / 1e9;
  std::printf(
      "Llama 3 %s, DP %lld x TP %lld, bf16, SP + loss parallel, batch %lld x seq %lld, %d steps after %d "
      "warm-up, interleaved; link: %s%s (measured %.2f Gbit/s)\n",
      preset.c_str(), static_cast<long long>(meshes.replicas()), static_cast<long long>(meshes.tp.size(0)),
      static_cast<long long>(b.batch_size), static_cast<long long>(b.seq_len), b.steps, b.warmup,
      bench::link_name().c_str(), rate.empty() ? "" : (", rate " + rate).c_str(), rate_bytes * 8 / 1e9);
  int name_width = 17;  // the longest configuration's name, so that the columns line up
  for (const auto& c : b.configs) name_width = std::max(name_width, static_cast<int>(c.name.size()));
  std::printf("%-*s %9s %17s %10s %9s %9s %9s %8s %8s %8s %8s %8s %8s %9s %9s\n", name_width, "config",
              "ms/step", "(min..max)", "tokens/s", "compute", "exposed", "MB sent", "speedup", "÷bound",
              "phases", "÷phases", "floor", "÷floor", "peak RSS", "CPU ms/MB");
  const double t_plain = results[0].step.median;
  for (size_t c = 0; c < results.size(); ++c) {
    const auto& m = results[c];
    const double t = m.step.median, bound = std::max(m.compute, m.bytes / rate_bytes);
    const auto bound_phase = [&](double compute, int64_t bytes) {
      return std::max(compute, bytes / rate_bytes);
    };
    const auto floor_phase = [&](double compute, int64_t bytes) {
      return std::max(compute + bytes * lost_per_byte, bytes / rate_bytes);
    };
    const double phases = over_phases(m, b.configs[c].steady, bound_phase);
    const double floor_bound = over_phases(m, b.configs[c].steady, floor_phase);
    std::printf(
        "%-*s %9.1f %8.1f..%-8.1f %10.0f %9.1f %9.1f %9.2f %7.2fx %7.2fx %8.1f %7.2fx %8.1f %7.2fx %6.0f MB "
        "%9.2f\n",
        name_width, b.configs[c].name.c_str(), t * 1e3, m.step.min * 1e3, m.step.max * 1e3,
        b.batch_size * b.seq_len / t, m.compute * 1e3, (t - m.compute) * 1e3, m.bytes / 1e6, t_plain / t,
        t / bound, phases * 1e3, t / phases, floor_bound * 1e3, t / floor_bound, m.peak_rss_mb,
        m.transport_cpu_ms_per_mb);
  }
  std::printf("model state (this rank's parameters, gradients and AdamW state, from their storages), MB:");
  for (size_t c = 0; c < results.size(); ++c) {
    std::printf(" %s %.1f;", b.configs[c].name.c_str(), results[c].state_mb);
  }
  std::printf("\n");
  report_regather(b, results);
  std::printf(
      "CPU ms/MB: (step CPU - compute-only CPU) / MB sent, all threads. The link alone (a 1 MiB send/recv "
      "stream), per MB sent: %.2f ms of this process's CPU, %.2f ms of the machine's per rank (softirq "
      "included; -1: no /proc/stat), %.2f ms of matmul lost beside it (the floor's)\n",
      link.cpu_ms_per_mb, link.machine_ms_per_mb, link.compute_lost_ms_per_mb);
  if (std::any_of(b.configs.begin(), b.configs.end(), [](const Config& c) { return c.steady; })) {
    std::printf(
        "phases and floor of a steady configuration: its optimizer phase and the next forward are one phase "
        "(the next step's gathers, started after each group's update, travel during that forward)\n");
  }
  report_exposed_waits(b, results);
  std::fflush(stdout);
}

// Each data-parallel configuration's buckets, in the order they start (after the measured steps:
// rebuilt where the configuration rebuilds): MB of gradient and the parameters of each.
void report_buckets(const Bench& b) {
  for (size_t c = 0; c < b.configs.size(); ++c) {
    const auto& reducer = b.real[c].reducer;
    if (!reducer) continue;
    std::map<const void*, std::string> names;
    for (const auto& item : b.real[c].model->named_parameters())
      names[item.value().unsafeGetTensorImpl()] = short_name(item.key());
    std::printf("%s buckets (MB [parameters], in launch order):", b.configs[c].name.c_str());
    for (const auto& bucket : reducer->bucket_parameters()) {
      int64_t bytes = 0;
      std::string members;
      for (auto p : bucket) {
        bytes += reducer->parameters()[p].nbytes();
        members += (members.empty() ? "" : " ") + names[reducer->parameters()[p].unsafeGetTensorImpl()];
      }
      std::printf(" %.1f [%s]", bytes / 1e6, members.c_str());
    }
    std::printf("\n");
  }
}

}  // namespace llama_step
