// Trains Llama 3 with tensor parallelism (+ sequence parallelism) on synthetic data.
//   hp-run --nproc-per-node 2 -- build/examples/torch/llama3/llama3_train --steps 20
//   ... llama3_train --steps 20 --checkpoint-dir /tmp/ckpt --checkpoint-every 5   (then --resume)
//   llama3_train --help
#include <chrono>
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include <hyper_parallel/core/comm.h>
#include <hyper_parallel/core/tensor_parallel/mc2/ops.h>

#include "common/run_main.h"
#include "train_defaults.h"
#include "trainer.h"

namespace {

// --mc2-chunks: auto, or a whole count (CLI::PositiveNumber would let 0.5 through as 0, auto).
CLI::Validator mc2_chunks_check() {
  return CLI::Validator(
      [](std::string& v) {
        const bool count = !v.empty() && v.size() <= 4 &&
                           v.find_first_not_of("0123456789") == std::string::npos && std::stoll(v) >= 1;
        return v == "auto" || count ? std::string()
                                    : "expected auto or a count from 1 to 9999, got '" + v + "'";
      },
      "auto|COUNT");
}

// The command line, as TrainOptions. Returns nullopt after printing help; throws
// CLI::ParseError on a bad flag.
// The flags' defaults: the table train.py reads too (train_defaults.json).
llama3::TrainOptions default_options() {
  namespace d = llama3::train_defaults;
  return llama3::TrainOptions()
      .preset(d::kPreset)
      .steps(d::kSteps)
      .batch_size(d::kBatchSize)
      .dp(d::kDp)
      .dtype(d::kDtype)
      .lr(d::kLr)
      .seed(d::kSeed)
      .mc2_scope(d::kMc2Scope)
      .checkpoint_every(d::kCheckpointEvery);
}

// --fsdp N [--hsdp R] [--no-reshard-after-forward]: the dp dim sharded with fully_shard.
struct ShardingFlags {
  int64_t fsdp = 0, hsdp = 1;
  bool keep_after_forward = false;
  CLI::Option* fsdp_flag = nullptr;

  void add(CLI::App& app, CLI::Option* dp_flag) {
    fsdp_flag = app.add_option("--fsdp", fsdp,
                               "shard parameters, gradients and AdamW state over N data-parallel ranks "
                               "(fully_shard; TP = world size / (N x hsdp))")
                    ->check(CLI::PositiveNumber)
                    ->excludes(dp_flag);
    app.add_option("--hsdp", hsdp, "HSDP: R replicas of the --fsdp shards (a {replicate, shard, tp} mesh)")
        ->capture_default_str()
        ->check(CLI::PositiveNumber)
        ->needs(fsdp_flag);
    app.add_flag("--no-reshard-after-forward", keep_after_forward,
                 "keep each block's gathered parameters from its forward to its backward")
        ->needs(fsdp_flag);
  }
  void apply(llama3::TrainOptions& o) const {
    if (fsdp == 0) return;
    o.fully_shard(true).dp(fsdp * hsdp).hsdp_replicate(hsdp).reshard_after_forward(!keep_after_forward);
  }
};

std::optional<llama3::TrainOptions> parse_flags(int argc, char** argv) {
  auto o = default_options();
  ShardingFlags sharding;
  std::string preset = o.preset(), dtype = o.dtype(), mc2_scope = o.mc2_scope();
  int64_t steps = o.steps(), batch_size = o.batch_size(), dp = o.dp();
  using hyper_parallel::tensor_parallel::MC2Options;
  std::string chunks =
      o.mc2_chunks_per_rank() == MC2Options::kAutoChunks ? "auto" : std::to_string(o.mc2_chunks_per_rank());
  std::optional<int64_t> seq_len;
  double lr = o.lr();
  uint64_t seed = o.seed();
  bool no_sp = false, loss_parallel = false, mc2 = false, relaxed = false, resume = false, async = false;
  std::string checkpoint_dir;
  int64_t checkpoint_every = o.checkpoint_every();

  CLI::App app(
      "Trains Llama 3 with tensor (+ sequence) and data parallelism on synthetic data; run it "
      "under hp-run: world = dp x TP ranks.",
      "llama3_train");
  app.add_option("--preset", preset, "model size")
      ->capture_default_str()
      ->check(CLI::IsMember({"debug", "tiny", "small", "bench", "llama3_8b", "llama3_8b_1layer"}));
  app.add_option("--steps", steps, "training steps")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size, "sequences per step (the global batch, split over --dp)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  auto* dp_flag = app.add_option("--dp", dp, "data-parallel replicas (TP = world size / dp)")
                      ->capture_default_str()
                      ->check(CLI::PositiveNumber);
  sharding.add(app, dp_flag);
  app.add_option("--seq-len", seq_len, "tokens per sequence (default: the preset's)")
      ->check(CLI::PositiveNumber);
  app.add_option("--dtype", dtype, "parameter and activation dtype")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--lr", lr, "AdamW learning rate")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--seed", seed, "weights and data")->capture_default_str();
  app.add_flag("--no-sequence-parallel", no_sp, "replicate activations between blocks");
  app.add_flag("--loss-parallel", loss_parallel, "keep logits sharded over the vocabulary");
  auto* mc2_flag = app.add_flag("--enable-mc2", mc2, "fuse the feed-forward's collectives into its matmuls");
  app.add_option("--mc2-chunks", chunks, "MC2 chunks per rank: a count, or auto (a cost model's, per op)")
      ->capture_default_str()
      ->check(mc2_chunks_check())
      ->needs(mc2_flag);
  app.add_flag("--relaxed-mc2-contract", relaxed, "allow fp32 and any size under MC2 (debugging)")
      ->needs(mc2_flag);
  app.add_option("--mc2-scope", mc2_scope,
                 "layers MC2 fuses: ffn, or all (also attention and, with "
                 "--loss-parallel, the output projection)")
      ->capture_default_str()
      ->check(CLI::IsMember({"ffn", "all"}))
      ->needs(mc2_flag);
  auto* dir_flag =
      app.add_option("--checkpoint-dir", checkpoint_dir, "checkpoint root: step-N/ directories and 'latest'");
  app.add_option("--checkpoint-every", checkpoint_every, "save every N steps and at the last step (0: never)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber)
      ->needs(dir_flag);
  app.add_flag("--resume", resume,
               "continue from the latest checkpoint in --checkpoint-dir (saved at any "
               "TP degree) up to --steps")
      ->needs(dir_flag);
  app.add_flag("--async-checkpoint", async, "write checkpoints on a background thread while training goes on")
      ->needs(dir_flag);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::printf("%s", app.help().c_str());
    return std::nullopt;
  }
  o.preset(preset).dtype(dtype).steps(steps).batch_size(batch_size).dp(dp).seq_len(seq_len).lr(lr).seed(seed);
  o.enable_sequence_parallel(!no_sp).enable_loss_parallel(loss_parallel);
  o.enable_mc2(mc2).mc2_scope(mc2_scope).relaxed_mc2_contract(relaxed).mc2_chunks_per_rank(
      chunks == "auto" ? MC2Options::kAutoChunks : std::stoll(chunks));
  o.checkpoint_dir(checkpoint_dir).checkpoint_every(checkpoint_every).resume(resume).async_checkpoint(async);
  sharding.apply(o);
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  std::optional<llama3::TrainOptions> options;
  try {
    options = parse_flags(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "llama3_train: %s\nTry 'llama3_train --help' for more information.\n", e.what());
    return 2;
  }
  if (!options) return 0;
  return hp_examples::run_main("llama3_train", [&] {
    namespace comm = hyper_parallel::comm;
    const auto t0 = std::chrono::steady_clock::now();
    comm::init_process_group();
    if (comm::global_rank() == 0) {
      std::printf("rendezvous of %lld ranks (attempt %lld) in %.2f s\n",
                  static_cast<long long>(comm::world_size()), static_cast<long long>(comm::restart_count()),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    auto results = llama3::train(*options);
    const bool fell = results.size() < 2 || results.back().loss < results.front().loss;
    if (results.empty()) {
      // Resumed from a checkpoint at or past --steps: nothing left to train.
      if (comm::global_rank() == 0) std::printf("no steps left to run\n");
    } else if (comm::global_rank() == 0) {
      std::printf("loss %s: %.4f -> %.4f (last %.17g)\n", fell ? "fell" : "did NOT fall",
                  results.front().loss, results.back().loss, results.back().loss);
    }
    comm::destroy_process_group();
    // A preempted run stops early by design: success.
    return fell || comm::preemption_requested() ? 0 : 1;
  });
}
