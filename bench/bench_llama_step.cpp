// Whole Llama 3 training steps, side by side in one launch: plain TP, MC2 on the feed-forward
// ("ffn") and MC2 on every Linear it can fuse ("all"), each built from the same seed, with
// sequence and loss parallelism on, steps interleaved. For each configuration it also runs a
// compute-only twin (the same model and shard shapes, transfers skipped), so
//   exposed communication = step time - compute-only step time,
// and it counts the payload bytes each rank sends per step, in the forward, the backward and the
// optimizer phase.
// The link's rate is measured in the same run (a send/recv stream), giving the step's bound
// max(T_compute_only, T_wire) and each configuration's step ÷ bound, and the phase-wise bound
// max(compute, wire) of the forward, of the backward and of the optimizer phase, and the
// floor: the phase-wise bound with the compute each phase's transfers take from the shared cores
// (measured beside the same stream) added to its compute. In both, a steady configuration's
// optimizer phase and next forward are one phase: its gathers travel in that forward. It also
// reports each configuration's peak RSS over its steps (VmHWM, reset before each step).
// With --dp N (TP = world / N) it compares data parallelism with blocking gradient reductions
// against the overlapped buckets of data_parallel and fully_shard over dp, resharding after each
// block's forward or not (with MC2 all when TP > 1); each replica runs batch / N sequences.
//
//   bash bench/run_bench.sh bench_llama_step 2gbit 2 -- --rates 250mbit 500mbit 2gbit
//   bash bench/run_bench.sh bench_llama_step 2gbit 2 -- --dp 2 --rates 500mbit 2gbit
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <torch/optim/adamw.h>

#include <hyper_parallel/hyper_parallel.h>

#include "bench_util.h"
#include "link_cost.h"
#include "llama_step.h"
#include "llama_step_report.h"
#include "common/run_main.h"
#include "llama3/model.h"
#include "llama3/parallelize.h"
#include "llama3/trainer.h"

// The compute-only twin of a step (an internal bench hook).
#include "core/comm/test_hooks.h"

namespace hp = hyper_parallel;
namespace tp = hp::tensor_parallel;
using namespace llama_step;

namespace {

std::unique_ptr<torch::optim::AdamW> adamw(const std::vector<at::Tensor>& params) {
  return std::make_unique<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(1e-3).weight_decay(0.1).betas({0.9, 0.95}));
}

// One AdamW over the model, or with early_gather one per group in the forward's order (the root's
// own parameters, the embedding, each block, the output layer); the root, the embedding and block 0
// (steady: every group) gather after their step. AdamW is per parameter, so the updates are those
// of one optimizer.
void add_optimizers(Run& run, const Config& c) {
  if (!c.early_gather) {
    run.optimizers.push_back({adamw(run.model->parameters()), std::nullopt});
    return;
  }
  TORCH_INTERNAL_ASSERT(c.dp == GradientSync::kFullyShard && c.split_root,
                        "bench_llama_step: early_gather needs fully_shard with split_root");
  using hp::fully_shard::FSDPModule;
  // A row-sparse embedding is not gathered whole ahead: its forward gathers the rows of its ids.
  std::vector<std::pair<FSDPModule, bool>> order{{*FSDPModule::of(*run.model), true},
                                                 {*FSDPModule::of(*run.model->tok_embeddings), c.ddp_layout}};
  for (size_t i = 0; i < run.model->layers->size(); ++i) {
    order.emplace_back(*FSDPModule::of(*run.model->layers[i]), i == 0 || c.steady);
  }
  order.emplace_back(*FSDPModule::of(*run.model->output), c.steady);
  for (auto& [module, gather_after] : order) {
    if (module.group() == nullptr) continue;
    run.optimizers.push_back({adamw(module.group()->parameters()),
                              gather_after ? std::optional<FSDPModule>(module) : std::nullopt});
  }
}

Run build(const Config& c, const llama3::ModelArgs& args, int64_t seq_len, const Meshes& meshes,
          double bucket_mb) {
  const auto& mesh = meshes.tp;
  at::manual_seed(42);  // the same full weights in every configuration
  Run run;
  run.model = llama3::Transformer(args);
  run.model->to(at::kBFloat16);
  llama3::parallelize_llama3(*run.model, mesh,
                             llama3::ParallelizeOptions()
                                 .enable_loss_parallel(true)
                                 .enable_mc2(c.mc2)
                                 .mc2_scope(c.scope)
                                 .mc2_options(tp::MC2Options().defer_weight_grads(c.defer_weight_grads))
                                 .seq_len(seq_len));
  if (c.dp == GradientSync::kFullyShard) {
    const auto options =
        hp::fully_shard::FullyShardOptions()
            .mesh(*meshes.dp)
            .reshard_after_forward(c.reshard_after_forward)
            .row_sparse_embeddings(!c.ddp_layout)
            .reduce_bucket_cap_bytes(
                c.fused_reduce ? 0 : hp::fully_shard::FullyShardOptions().reduce_bucket_cap_bytes());
    // With split_root, the output layer's gradients reduce as soon as its backward ends (first), not
    // with the embedding's at the end of the backward.
    if (c.split_root) {
      hp::fully_shard::fully_shard(*run.model->tok_embeddings, options);
      hp::fully_shard::fully_shard(*run.model->output, options);
    }
    for (const auto& block : *run.model->layers) hp::fully_shard::fully_shard(*block, options);
    hp::fully_shard::fully_shard(*run.model, options);
  } else if (c.dp != GradientSync::kNone) {
    const auto options = hp::data_parallel::GradientReducerOptions()
                             .overlap(c.dp == GradientSync::kOverlapped)
                             .grow_first_buckets(!c.ddp_layout)
                             .shrink_last_buckets(!c.ddp_layout)
                             .bucket_cap_bytes(static_cast<int64_t>(bucket_mb * (1 << 20)));
    // DDP's: over the parameters, so that the embedding's gradient is reduced dense too.
    run.reducer = c.ddp_layout
                      ? hp::data_parallel::data_parallel(run.model->parameters(), *meshes.dp, options)
                      : hp::data_parallel::data_parallel(*run.model, *meshes.dp, options);
  }
  add_optimizers(run, c);
  return run;
}

// One training step, timed by phase (forward with the loss, backward, clipping and optimizer),
// with the payload bytes this rank sent in the forward and in the backward.
struct StepTimes {
  double total = 0, forward = 0, backward = 0, optimizer = 0;
  double cpu = 0;  // user + system seconds of every thread of the process
  int64_t forward_bytes = 0, backward_bytes = 0, optimizer_bytes = 0;
  std::vector<hp::comm::ExposedWait> waits;  // this rank's blocked time per region and op
};

// The next step's gathers that `run`'s optimizer phase started (early_gather) are over.
void wait_for_early_gathers(Run& run) {
  for (auto& o : run.optimizers) {
    if (o.gather_after) o.gather_after->wait_for_unshard();
  }
}

// `steady`: the step follows one of the same run, whose gathers are still in flight (no barrier
// first, which would wait behind them untimed), and does not wait for its own.
StepTimes step(Run& run, at::Tensor batch, int64_t seq_len, int64_t vocab, const Meshes& meshes,
               bool steady = false) {
  const auto& mesh = meshes.tp;
  const int64_t rows = batch.size(0) / meshes.replicas();
  batch = batch.narrow(0, meshes.replica() * rows, rows);  // this replica's share
  if (!steady) hp::comm::barrier(meshes.world);
  hp::comm::reset_collective_counts();  // after the barrier: its wait is rank skew, not the step's
  StepTimes t;
  const int64_t before = hp::comm::payload_bytes_sent();
  const double cpu0 = bench::process_cpu_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  auto since = [](std::chrono::steady_clock::time_point from) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - from).count();
  };
  for (auto& o : run.optimizers) o.optimizer->zero_grad();
  at::Tensor loss;
  {
    hp::comm::CommRegion region("forward");
    auto logits = run.model->forward(batch.narrow(1, 0, seq_len));
    loss = tp::vocab_parallel_cross_entropy(logits, batch.narrow(1, 1, seq_len), vocab, mesh);
  }
  t.forward = since(t0);
  t.forward_bytes = hp::comm::payload_bytes_sent() - before;
  const auto t1 = std::chrono::steady_clock::now();
  {
    hp::comm::CommRegion region("backward");
    loss.backward();
  }
  t.backward = since(t1);
  t.backward_bytes = hp::comm::payload_bytes_sent() - before - t.forward_bytes;
  const auto t2 = std::chrono::steady_clock::now();
  {
    hp::comm::CommRegion region("optimizer");
    tp::clip_grad_norm_(*run.model, 1.0);
    for (auto& o : run.optimizers) {
      o.optimizer->step();
      if (o.gather_after) o.gather_after->unshard(/*async_op=*/true);
    }
    // Unless steady, the next step's first gathers end within this step: steps of other
    // configurations run next.
    if (!steady) wait_for_early_gathers(run);
  }
  t.optimizer = since(t2);
  t.optimizer_bytes = hp::comm::payload_bytes_sent() - before - t.forward_bytes - t.backward_bytes;
  t.total = since(t0);
  t.waits = hp::comm::exposed_waits();
  t.cpu = bench::process_cpu_seconds() - cpu0;
  return t;
}

// The peak resident set since the last reset (VmHWM), in MB; reset_peak_rss() starts a new peak.
void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }
double peak_rss_mb() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return 0;
}

// Interleaved steps of every configuration and its compute-only twin.
std::vector<Measured> measure(Bench& b, const Meshes& mesh) {
  const auto group = mesh.world;
  const size_t n = b.configs.size();
  std::vector<std::vector<double>> real(n), compute(n), fwd(n), bwd(n), opt(n), cpu_per_mb(n);
  std::vector<Measured> out(n);
  for (int s = 0; s < b.warmup + b.steps; ++s, ++b.step_index) {
    auto batch = llama3::synthetic_batch(42, b.step_index, b.batch_size, b.seq_len, b.args.vocab_size);
    for (size_t c = 0; c < n; ++c) {
      reset_peak_rss();
      const bool steady = b.configs[c].steady;
      if (steady) step(b.real[c], batch, b.seq_len, b.args.vocab_size, mesh, true);  // untimed
      const auto t = step(b.real[c], batch, b.seq_len, b.args.vocab_size, mesh, steady);
      if (steady) wait_for_early_gathers(b.real[c]);
      out[c].peak_rss_mb = std::max(out[c].peak_rss_mb, peak_rss_mb());
      StepTimes twin;
      {
        hp::comm::test_hooks::SkipTransfers skip;
        twin = step(b.compute_only[c], batch, b.seq_len, b.args.vocab_size, mesh);
      }
      // SkipTransfers is the calling thread's: a transfer posted from another thread would escape it.
      const int64_t twin_bytes = twin.forward_bytes + twin.backward_bytes + twin.optimizer_bytes;
      TORCH_CHECK(twin_bytes == 0, "bench_llama_step: the compute-only twin of ", b.configs[c].name, " sent ",
                  twin_bytes, " payload bytes");
      if (s < b.warmup) continue;
      real[c].push_back(t.total);
      compute[c].push_back(twin.total);
      fwd[c].push_back(twin.forward);
      bwd[c].push_back(twin.backward);
      opt[c].push_back(twin.optimizer);
      const int64_t bytes = t.forward_bytes + t.backward_bytes + t.optimizer_bytes;
      if (bytes > 0) cpu_per_mb[c].push_back((t.cpu - twin.cpu) * 1e3 / (bytes / 1e6));
      for (const auto& w : t.waits) out[c].waits[{w.region, w.op}] += w.seconds / b.steps;
      out[c].forward_bytes = t.forward_bytes;
      out[c].backward_bytes = t.backward_bytes;
      out[c].optimizer_bytes = t.optimizer_bytes;
      out[c].bytes = bytes;
    }
  }
  for (size_t c = 0; c < n; ++c) {
    std::vector<torch::optim::AdamW*> optimizers;
    for (auto& o : b.real[c].optimizers) optimizers.push_back(o.optimizer.get());
    out[c].state_mb = bench::model_state_bytes(*b.real[c].model, optimizers) / 1e6;
    out[c].step = bench::slowest(real[c], group);
    out[c].compute = bench::slowest(compute[c], group).median;
    out[c].compute_forward = bench::slowest(fwd[c], group).median;
    out[c].compute_backward = bench::slowest(bwd[c], group).median;
    out[c].compute_optimizer = bench::slowest(opt[c], group).median;
    if (!cpu_per_mb[c].empty()) out[c].transport_cpu_ms_per_mb = bench::slowest(cpu_per_mb[c], group).median;
  }
  return out;
}

// {tp} over the world, or {dp, tp}: the TP groups are consecutive ranks.
Meshes make_meshes(int64_t dp) {
  const int64_t p = hp::comm::world_size();
  TORCH_CHECK_VALUE(dp >= 1 && p % dp == 0, "bench_llama_step: expected --dp to divide the world size (", p,
                    "), got ", dp);
  if (dp == 1) return {hp::dtensor::init_device_mesh("cpu", {p}, {"tp"}), std::nullopt, hp::comm::world()};
  auto mesh = hp::dtensor::init_device_mesh("cpu", {dp, p / dp}, {"dp", "tp"});
  return {mesh["tp"], mesh["dp"], hp::comm::world()};
}

// TP alone: plain, MC2 ffn, MC2 all with each weight gradient in its own node ("serial dW"),
// MC2 all (row and shared-gather weight gradients deferred into the next row backward's gather
// window). With DP: blocking against overlapped gradient reductions, and the overlapped ones in
// DDP's bucket layout ("DP overlap DDP": rebuilt in the backward's order, neither growing first
// buckets nor shrinking last ones, the embedding's gradient reduced dense), and fully_shard over dp
// with the gathered parameters freed after each block's forward ("FSDP") or kept ("FSDP keep"), and
// kept with the embedding and the output layer in groups of their own ("FSDP keep split") (MC2 all
// inside each replica when TP > 1), and that with the first groups gathered for the next step
// right after their own optimizer step ("FSDP keep early"), and that with the embedding's gradient
// gathered whole and reduce-scattered dense ("FSDP keep early dense emb"; with a group of its own,
// the embedding's forward gathers only the rows of its tokens and its reduce-scatter sends only
// the rows they touched), and that with each group's gradients in one reduce-scatter after its
// whole backward ("FSDP keep early fused RS"; by default they leave in buckets as they come), and
// "FSDP keep early" as a training loop runs it: every group gathers after its step, and the next
// step's forward finds the gathers in flight ("FSDP keep early steady", see Config::steady), also with
// the embedding gathered whole, first ("FSDP keep early dense emb steady").
std::vector<Config> configs_for(const Meshes& meshes) {
  if (!meshes.dp) {
    return {{"plain TP", false, llama3::MC2Scope::kFfn},
            {"MC2 ffn", true, llama3::MC2Scope::kFfn},
            {"MC2 all serial dW", true, llama3::MC2Scope::kAll, GradientSync::kNone, false},
            {"MC2 all", true, llama3::MC2Scope::kAll}};
  }
  const bool mc2 = meshes.tp.size(0) > 1;
  const auto scope = mc2 ? llama3::MC2Scope::kAll : llama3::MC2Scope::kFfn;
  return {{"DP blocking", mc2, scope, GradientSync::kBlocking},
          {"DP overlap", mc2, scope, GradientSync::kOverlapped},
          {"DP overlap DDP", mc2, scope, GradientSync::kOverlapped, true, true},
          {"FSDP", mc2, scope, GradientSync::kFullyShard},
          {"FSDP keep", mc2, scope, GradientSync::kFullyShard, true, false, false},
          {"FSDP keep split", mc2, scope, GradientSync::kFullyShard, true, false, false, true},
          {"FSDP keep early", mc2, scope, GradientSync::kFullyShard, true, false, false, true, true},
          {"FSDP keep early dense emb", mc2, scope, GradientSync::kFullyShard, true, true, false, true, true},
          {"FSDP keep early fused RS", mc2, scope, GradientSync::kFullyShard, true, false, false, true, true,
           true},
          {"FSDP keep early steady", mc2, scope, GradientSync::kFullyShard, true, false, false, true, true,
           false, true},
          {"FSDP keep early dense emb steady", mc2, scope, GradientSync::kFullyShard, true, true, false, true,
           true, false, true}};
}

// The configurations named in `only` (all if empty), in that order; a c10::ValueError names the
// known ones.
std::vector<Config> select_configs(const std::vector<Config>& all, const std::vector<std::string>& only) {
  if (only.empty()) return all;
  std::vector<Config> chosen;
  std::string known;
  for (const auto& c : all) known += (known.empty() ? "'" : ", '") + c.name + "'";
  for (const auto& name : only) {
    auto it = std::find_if(all.begin(), all.end(), [&](const Config& c) { return c.name == name; });
    TORCH_CHECK_VALUE(it != all.end(), "expected --configs among ", known, ", got '", name, "'");
    chosen.push_back(*it);
  }
  return chosen;
}

}  // namespace

int main(int argc, char** argv) {
  Bench b;
  b.steps = 10;
  b.warmup = 3;
  b.batch_size = 8;
  int64_t dp = 1;
  std::string preset = "bench";
  std::vector<std::string> rates;
  CLI::App app(
      "Llama 3 training steps: plain TP, MC2 ffn and MC2 all (or, with --dp, blocking and overlapped "
      "gradient reductions), interleaved in one launch.",
      "bench_llama_step");
  app.add_option("--steps", b.steps, "measured steps per configuration")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", b.warmup, "steps before measuring")->capture_default_str();
  app.add_option("--batch-size", b.batch_size, "sequences per step (the global batch)")
      ->capture_default_str();
  app.add_option("--dp", dp, "data-parallel replicas (TP = world / dp)")->capture_default_str();
  app.add_option("--bucket-mb", b.bucket_mb, "data_parallel's bucket cap, MiB")->capture_default_str();
  app.add_option("--preset", preset, "model size")->capture_default_str();
  std::vector<std::string> only;
  app.add_option("--configs", only, "measure only these configurations (names as printed), in this order");
  app.add_option("--rates", rates, "link rates to measure at, e.g. 250mbit (needs HP_BENCH_RATE_CMD)");
  CLI11_PARSE(app, argc, argv);

  return hp_examples::run_main("bench_llama_step", [&] {
    bench::keep_freed_memory();
    hp::comm::init_process_group();
    const auto meshes = make_meshes(dp);
    const auto group = meshes.world;
    b.args = llama3::ModelArgs::from_preset(preset);
    b.seq_len = b.args.max_seq_len;
    b.configs = select_configs(configs_for(meshes), only);
    for (const auto& c : b.configs) {
      b.real.push_back(build(c, b.args, b.seq_len, meshes, b.bucket_mb));
      b.compute_only.push_back(build(c, b.args, b.seq_len, meshes, b.bucket_mb));
    }
    const bool print = group.rank() == 0;
    const auto rate_cmd = bench::rate_command();
    if (!rates.empty() && rate_cmd.empty()) {
      // On loopback (or any link this program cannot shape) the rates mean nothing.
      if (print) std::printf("bench_llama_step: no HP_BENCH_RATE_CMD (loopback?): --rates ignored\n");
      rates.clear();
    }
    if (rates.empty()) rates.push_back("");
    for (const auto& rate : rates) {
      if (!rate.empty()) bench::set_rate("bench_llama_step", rate_cmd, rate, group);
      const auto results = measure(b, meshes);
      const auto link = bench::measure_link(group, std::max<int64_t>(results[0].bytes, int64_t{8} << 20));
      if (print) report(b, results, preset, rate, link, meshes);
      if (print && rate == rates.front()) report_buckets(b);
      // What the trainers add to every step to stop together on a preemption notice.
      const auto agree = bench::time_calls(group, 50, [&] { hp::comm::agree_on_preemption(group); });
      if (print) {
        std::printf("per-step preemption agreement (one 4-byte all_reduce): %.1f us = %.3f%% of a %s step\n",
                    agree.median * 1e6, 100 * agree.median / results[0].step.median,
                    b.configs[0].name.c_str());
      }
    }
    hp::comm::destroy_process_group();
    return 0;
  });
}
