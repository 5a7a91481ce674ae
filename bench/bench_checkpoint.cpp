// Checkpoint saves during Llama 3 training, synchronous against asynchronous, side by side in
// one launch (bf16, AdamW, TP over the world, loss parallel):
//   stall        how long the step loop is blocked per save (sync: the whole save; async: the
//                plan's agreement and the snapshot copy)
//   step         a training step alone, and one that runs while an async save is being written
//   writer       the background part of an async save: wall and CPU time of the writer thread
//   20 steps     20 steps without saves, with a sync save every 2 steps, with an async one
// Saves go to --dir (fsynced, as the trainers save); rounds are interleaved so that a shared
// machine's drift hits both kinds alike.
//
//   hp-run --nproc-per-node 2 -- build/bench/bench_checkpoint --preset bench
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <torch/optim/adamw.h>

#include <hyper_parallel/hyper_parallel.h>

#include "bench_util.h"
#include "common/run_main.h"
#include "llama3/model.h"
#include "llama3/parallelize.h"
#include "llama3/trainer.h"

namespace hp = hyper_parallel;
namespace ckpt = hp::checkpoint;
namespace tp = hp::tensor_parallel;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Trainee {
  llama3::ModelArgs args;
  hp::dtensor::DeviceMesh mesh;
  llama3::Transformer model{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer;
  ckpt::State state;
  int64_t batch_size = 0, step_index = 0;

  Trainee(llama3::ModelArgs a, hp::dtensor::DeviceMesh m, int64_t batch)
      : args(a), mesh(m), batch_size(batch) {
    at::manual_seed(42);
    model = llama3::Transformer(args);
    model->to(at::kBFloat16);
    llama3::parallelize_llama3(*model, mesh, llama3::ParallelizeOptions().enable_loss_parallel(true));
    optimizer = std::make_unique<torch::optim::AdamW>(
        model->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.1).betas({0.9, 0.95}));
    state = ckpt::model_state(*model);
    ckpt::add_optimizer_state(state, *optimizer, *model);
  }

  // One step, started together on every rank; its seconds.
  double step() {
    hp::comm::barrier(mesh.get_group(0));
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t s = args.max_seq_len;
    auto batch = llama3::synthetic_batch(42, ++step_index, batch_size, s, args.vocab_size);
    optimizer->zero_grad();
    auto logits = model->forward(batch.narrow(1, 0, s));
    tp::vocab_parallel_cross_entropy(logits, batch.narrow(1, 1, s), args.vocab_size, mesh).backward();
    tp::clip_grad_norm_(*model, 1.0);
    optimizer->step();
    return seconds_since(t0);
  }

  // A save started together on every rank; the seconds the caller was blocked.
  double save(const std::string& root, bool async) {
    hp::comm::barrier(mesh.get_group(0));
    const auto t0 = std::chrono::steady_clock::now();
    ckpt::save(root, state, ckpt::SaveOptions().step(step_index).asynchronous(async));
    return seconds_since(t0);
  }
};

struct PerSave {
  std::vector<double> sync_stall, async_stall, step_alone, step_writing, writer_wall, writer_cpu;
};

// Each round: a step alone, a sync save, an async save and the step that runs while it is
// written, then finish().
PerSave per_save(Trainee& t, const std::string& dir, int rounds) {
  PerSave m;
  for (int r = 0; r < rounds; ++r) {
    m.step_alone.push_back(t.step());
    m.sync_stall.push_back(t.save(dir + "/sync", false));
    m.async_stall.push_back(t.save(dir + "/async", true));
    m.step_writing.push_back(t.step());
    const auto done = ckpt::finish();
    m.writer_wall.push_back(done->background_seconds);
    m.writer_cpu.push_back(done->background_cpu_seconds);
  }
  return m;
}

// `steps` steps, saving every 2 steps: 0 none, 1 sync, 2 async. Total seconds, and of them the
// steps' and the saves' (with the final finish()).
struct RunTimes {
  double total = 0, steps = 0, saves = 0;
};
RunTimes run_steps(Trainee& t, const std::string& dir, int steps, int mode) {
  hp::comm::barrier(t.mesh.get_group(0));
  RunTimes r;
  const auto t0 = std::chrono::steady_clock::now();
  for (int s = 1; s <= steps; ++s) {
    r.steps += t.step();
    if (mode != 0 && s % 2 == 0) r.saves += t.save(dir + (mode == 1 ? "/run-sync" : "/run-async"), mode == 2);
  }
  const auto f0 = std::chrono::steady_clock::now();
  if (mode == 2) ckpt::finish();
  r.saves += seconds_since(f0);
  r.total = seconds_since(t0);
  return r;
}

// The slowest rank's statistics of everything measured.
struct Report {
  std::vector<bench::Stats> per_save;  // sync stall, async stall, step alone, step writing, wall, cpu
  std::vector<bench::Stats> total, step_part, save_part;  // by mode
};

std::vector<bench::Stats> slowest_of(const PerSave& m, const hp::comm::Group& group) {
  std::vector<bench::Stats> out;
  for (const auto* v :
       {&m.sync_stall, &m.async_stall, &m.step_alone, &m.step_writing, &m.writer_wall, &m.writer_cpu}) {
    out.push_back(bench::slowest(*v, group));
  }
  return out;
}

void print_row(const char* what, const bench::Stats& s, const char* note = "") {
  std::printf("%-34s %9.1f ms  (%.1f..%.1f) %s\n", what, s.median * 1e3, s.min * 1e3, s.max * 1e3, note);
}

void print_report(const Report& r, int steps) {
  const auto &sync = r.per_save[0], &async = r.per_save[1], &alone = r.per_save[2], &writing = r.per_save[3];
  print_row("stall per save, sync", sync);
  char note[128];
  std::snprintf(note, sizeof note, "= %.1f%% of the sync stall", 100 * async.median / sync.median);
  print_row("stall per save, async", async, note);
  print_row("step alone", alone);
  std::snprintf(note, sizeof note, "= %.3fx the step alone", writing.median / alone.median);
  print_row("step while an async save writes", writing, note);
  print_row("async writer, wall", r.per_save[4]);
  print_row("async writer, CPU", r.per_save[5]);
  const char* names[] = {"no saves", "sync save every 2 steps", "async save every 2 steps"};
  for (int mode = 0; mode < 3; ++mode) {
    std::printf("%d steps, %-25s %7.2f s (%.2f..%.2f) %+6.1f%%   of it: steps %6.2f s, saves %5.2f s\n",
                steps, names[mode], r.total[mode].median, r.total[mode].min, r.total[mode].max,
                100 * (r.total[mode].median / r.total[0].median - 1), r.step_part[mode].median,
                r.save_part[mode].median);
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::string preset = "bench", dir;
  int rounds = 5, steps = 20, repeats = 3;
  int64_t batch_size = 4;
  CLI::App app("Checkpoint saves during Llama 3 training: synchronous against asynchronous.",
               "bench_checkpoint");
  app.add_option("--preset", preset, "model size")->capture_default_str();
  app.add_option("--batch-size", batch_size, "sequences per step")->capture_default_str();
  app.add_option("--rounds", rounds, "saves of each kind measured one by one")->capture_default_str();
  app.add_option("--steps", steps, "steps of the runs with a save every 2 steps")->capture_default_str();
  app.add_option("--repeats", repeats, "interleaved repeats of the three runs")->capture_default_str();
  app.add_option("--dir", dir, "checkpoint root (default: a fresh directory under /tmp, removed after)");
  CLI11_PARSE(app, argc, argv);

  return hp_examples::run_main("bench_checkpoint", [&] {
    bench::keep_freed_memory();
    hp::comm::init_process_group();
    const int64_t p = hp::comm::world_size();
    auto mesh = hp::dtensor::init_device_mesh("cpu", {p}, {"tp"});
    const auto group = mesh.get_group(0);
    const bool print = group.rank() == 0, own_dir = dir.empty();
    if (own_dir) {
      auto id = at::full({1}, static_cast<int64_t>(::getpid()), at::kLong);
      dir = "/tmp/hp_bench_checkpoint_" +
            std::to_string(hp::comm::broadcast(id, 0, hp::comm::world()).item<int64_t>());
    }
    Trainee t(llama3::ModelArgs::from_preset(preset), mesh, batch_size);
    for (int w = 0; w < 2; ++w) t.step();
    t.save(dir + "/warmup", true);  // makes the writer's group and its buffers
    const auto promised = ckpt::finish();
    const auto m = per_save(t, dir, rounds);
    // The three runs, interleaved: none, sync, async, none, sync, async, ...
    std::vector<std::vector<double>> totals(3), step_parts(3), save_parts(3);
    for (int repeat = 0; repeat < repeats; ++repeat) {
      for (int mode = 0; mode < 3; ++mode) {
        const auto r = run_steps(t, dir, steps, mode);
        totals[mode].push_back(r.total);
        step_parts[mode].push_back(r.steps);
        save_parts[mode].push_back(r.saves);
      }
    }
    Report report{slowest_of(m, group), {}, {}, {}};
    for (int mode = 0; mode < 3; ++mode) {
      report.total.push_back(bench::slowest(totals[mode], group));
      report.step_part.push_back(bench::slowest(step_parts[mode], group));
      report.save_part.push_back(bench::slowest(save_parts[mode], group));
    }
    if (print) {
      std::printf(
          "Llama 3 %s, TP %lld, bf16 + AdamW, batch %lld; checkpoint %.1f MB (this rank writes %.1f MB, "
          "its snapshot); %d rounds, %d x %d-step runs; disk under %s; link: %s\n",
          preset.c_str(), static_cast<long long>(p), static_cast<long long>(batch_size),
          promised->total_bytes / 1e6, promised->bytes_written / 1e6, rounds, repeats, steps, dir.c_str(),
          bench::link_name().c_str());
      print_report(report, steps);
    }
    hp::comm::barrier(group);
    if (own_dir && print) std::filesystem::remove_all(dir);
    hp::comm::destroy_process_group();
    return 0;
  });
}
