#include "trainer.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include <ATen/ATen.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <hyper_parallel/checkpoint.h>
#include <hyper_parallel/core/comm.h>
#include <hyper_parallel/core/data_parallel.h>
#include <hyper_parallel/core/dtensor.h>
#include <hyper_parallel/core/fully_shard.h>
#include <hyper_parallel/core/tensor_parallel.h>

#include "parallelize.h"

namespace llama3 {

namespace hp = hyper_parallel;

at::Tensor synthetic_batch(uint64_t seed, int64_t step, int64_t batch_size, int64_t seq_len,
                           int64_t vocab_size) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003 + static_cast<uint64_t>(step));
  auto start = at::randint(vocab_size, {batch_size}, gen, at::kLong);
  std::vector<at::Tensor> cols{start};
  for (int64_t i = 1; i <= seq_len; ++i) cols.push_back((cols.back() * 5 + 3).remainder(vocab_size));
  return at::stack(cols, 1);  // [B, S + 1]: inputs are [:, :S], targets [:, 1:]
}

namespace {

// What a run is made of, derived once from its options.
struct Run {
  TrainOptions options;
  ModelArgs args;
  int64_t seq_len = 0;
  at::ScalarType dtype = at::kFloat;
  hp::dtensor::DeviceMesh mesh;  // tensor parallel: the whole world, or mesh["tp"] of {dp, tp}
  std::optional<hp::dtensor::DeviceMesh> dp_mesh;  // with dp > 1: replicated (data_parallel) or sharded
  bool log = false;

  // The replicas' groups (dp, or replicate and shard) and this rank's replica, 0 .. dp - 1.
  std::vector<hp::comm::Group> replica_groups() const {
    if (!dp_mesh) return {};
    std::vector<hp::comm::Group> out;
    for (int64_t d = 0; d < dp_mesh->ndim(); ++d) out.push_back(dp_mesh->get_group(d));
    return out;
  }
  int64_t replica() const {
    if (!dp_mesh) return 0;
    int64_t index = 0;
    for (int64_t d = 0; d < dp_mesh->ndim(); ++d)
      index = index * dp_mesh->size(d) + dp_mesh->get_local_rank(d);
    return index;
  }
};

// {tp} over the world, or {dp, tp} with dp > 1 (the TP groups are consecutive ranks); with
// HSDP {replicate, shard, tp}, the dp mesh being its {replicate, shard}.
std::pair<hp::dtensor::DeviceMesh, std::optional<hp::dtensor::DeviceMesh>> make_meshes(
    const TrainOptions& o) {
  const int64_t world = hp::comm::world_size();
  TORCH_CHECK_VALUE(o.dp() >= 1 && world % o.dp() == 0,
                    "llama3::train: expected dp to divide the world size (", world, "), got ", o.dp());
  TORCH_CHECK_VALUE(o.batch_size() % o.dp() == 0, "llama3::train: expected batch_size divisible by dp (",
                    o.dp(), "), got ", o.batch_size());
  const int64_t replicate = o.hsdp_replicate();
  TORCH_CHECK_VALUE(replicate == 1 || (o.fully_shard() && replicate >= 1 && o.dp() % replicate == 0),
                    "llama3::train: expected hsdp_replicate 1, or with fully_shard a divisor of dp (", o.dp(),
                    "), got ", replicate);
  if (o.reference() || (o.dp() == 1 && !o.fully_shard()))
    return {hp::dtensor::init_device_mesh("cpu", {world}, {"tp"}), std::nullopt};
  if (replicate > 1) {
    auto mesh = hp::dtensor::init_device_mesh("cpu", {replicate, o.dp() / replicate, world / o.dp()},
                                              {"replicate", "shard", "tp"});
    return {mesh["tp"], mesh[std::vector<std::string>{"replicate", "shard"}]};
  }
  auto mesh = hp::dtensor::init_device_mesh("cpu", {o.dp(), world / o.dp()}, {"dp", "tp"});
  return {mesh["tp"], mesh["dp"]};
}

Run make_run(const TrainOptions& options) {
  TORCH_CHECK(options.dtype() == "fp32" || options.dtype() == "bf16",
              "llama3::train: expected dtype 'fp32' or 'bf16', got '", options.dtype(), "'");
  TORCH_CHECK(options.checkpoint_every() >= 0, "llama3::train: expected checkpoint_every >= 0, got ",
              options.checkpoint_every());
  TORCH_CHECK(!options.checkpoint_dir().empty() || (options.checkpoint_every() == 0 && !options.resume()),
              "llama3::train: expected a checkpoint_dir with checkpoint_every or resume");
  const auto args = options.model_args().value_or(ModelArgs::from_preset(options.preset()));
  auto [mesh, dp_mesh] = make_meshes(options);
  return {options,
          args,
          options.seq_len().value_or(args.max_seq_len),
          options.dtype() == "bf16" ? at::kBFloat16 : at::kFloat,
          mesh,
          dp_mesh,
          options.log() && hp::comm::global_rank() == 0};
}

// Full weights from the seed, identical on every rank and TP degree, then the plan.
Transformer build_model(const Run& run) {
  const auto& o = run.options;
  at::manual_seed(o.seed());
  Transformer model(run.args);
  model->to(run.dtype);
  if (o.reference()) return model;
  const auto contract = o.relaxed_mc2_contract() ? hp::tensor_parallel::MC2Contract::relaxed()
                                                 : hp::tensor_parallel::MC2Contract::strict();
  parallelize_llama3(
      *model, run.mesh,
      ParallelizeOptions()
          .enable_sequence_parallel(o.enable_sequence_parallel())
          .enable_loss_parallel(o.enable_loss_parallel())
          .enable_mc2(o.enable_mc2())
          .mc2_scope(mc2_scope_from_string(o.mc2_scope()))
          .mc2_contract(contract)
          .mc2_options(hp::tensor_parallel::MC2Options().chunks_per_rank(o.mc2_chunks_per_rank()))
          .seq_len(run.seq_len));
  if (o.fully_shard()) {
    // Bottom-up, as torchtitan: each block, then the root (embedding, norm, output).
    const auto options = hp::fully_shard::FullyShardOptions()
                             .mesh(*run.dp_mesh)
                             .reshard_after_forward(o.reshard_after_forward());
    for (const auto& block : *model->layers) hp::fully_shard::fully_shard(*block, options);
    hp::fully_shard::fully_shard(*model, options);
  }
  return model;
}

void print_banner(const Run& run) {
  const auto& o = run.options;
  const int64_t tp_size = o.reference() ? 1 : run.mesh.size(0);
  const int64_t dp_size = run.dp_mesh ? o.dp() : 1;
  const std::string mc2 = o.enable_mc2() && !o.reference() ? "on (" + o.mc2_scope() + ")" : "off";
  const std::string dp_mode = !o.fully_shard() ? ""
                              : o.hsdp_replicate() > 1
                                  ? " (HSDP " + std::to_string(o.hsdp_replicate()) + " x " +
                                        std::to_string(o.dp() / o.hsdp_replicate()) + ")"
                                  : " (fully_shard)";
  std::printf(
      "llama3 %s: %lld layers, dim %lld, DP %lld%s, TP %lld, SP %s, MC2 %s, loss parallel %s, %s, batch %lld "
      "x "
      "seq %lld\n",
      o.model_args() ? "custom" : o.preset().c_str(), static_cast<long long>(run.args.n_layers),
      static_cast<long long>(run.args.dim), static_cast<long long>(dp_size), dp_mode.c_str(),
      static_cast<long long>(tp_size), o.enable_sequence_parallel() ? "on" : "off", mc2.c_str(),
      o.enable_loss_parallel() ? "on" : "off", o.dtype().c_str(), static_cast<long long>(o.batch_size()),
      static_cast<long long>(run.seq_len));
  std::fflush(stdout);
}

// The first step to run: after the latest checkpoint in checkpoint_dir, if there is one (a job
// restarted after a failure or a preemption continues by itself); with `resume`, one must exist.
int64_t resume(const Run& run, hp::checkpoint::State& state) {
  const auto& dir = run.options.checkpoint_dir();
  if (dir.empty()) return 1;
  const auto latest = hp::checkpoint::latest_step(dir);
  TORCH_CHECK(latest.has_value() || !run.options.resume(),
              "llama3::train: expected a checkpoint to resume from in '", dir,
              "', got none (no 'latest' file)");
  if (!latest) return 1;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string step_dir = hp::checkpoint::step_dir(dir, *latest);
  hp::checkpoint::load(step_dir, state);
  if (run.log) {
    std::printf("resumed from step %lld (%s) in %.2f s\n", static_cast<long long>(*latest), step_dir.c_str(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::fflush(stdout);
  }
  return *latest + 1;
}

// One step: forward, loss, backward, `inspect`, clipping, the optimizer.
StepResult train_step(const Run& run, TransformerImpl& model, torch::optim::AdamW& optimizer, int64_t step,
                      const std::function<void(int64_t, TransformerImpl&)>& inspect) {
  const auto& o = run.options;
  const auto t0 = std::chrono::steady_clock::now();
  auto batch = synthetic_batch(o.seed(), step, o.batch_size(), run.seq_len, run.args.vocab_size);
  if (run.dp_mesh) {  // this replica's rows of the global batch
    const int64_t rows = o.batch_size() / o.dp();
    batch = batch.narrow(0, run.replica() * rows, rows);
  }
  auto inputs = batch.narrow(1, 0, run.seq_len), targets = batch.narrow(1, 1, run.seq_len);
  optimizer.zero_grad();
  auto logits = model.forward(inputs);
  at::Tensor loss;
  if (o.enable_loss_parallel() && !o.reference()) {
    loss = hp::tensor_parallel::vocab_parallel_cross_entropy(logits, targets, run.args.vocab_size, run.mesh);
  } else {
    loss = at::cross_entropy_loss(logits.flatten(0, 1).to(at::kFloat), targets.flatten());
  }
  loss.backward();
  if (inspect) inspect(step, model);
  const double grad_norm = hp::tensor_parallel::clip_grad_norm_(model, o.max_norm());
  optimizer.step();
  // The global batch's loss: the replicas' mean losses averaged (float32, deterministic).
  auto global_loss = loss.detach().to(at::kFloat).reshape({1});
  for (const auto& group : run.replica_groups()) {
    global_loss = hp::comm::all_reduce(global_loss, hp::comm::ReduceOp::kAvg, group);
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return {step, global_loss.item<double>(), grad_norm, ms,
          1000.0 * static_cast<double>(o.batch_size() * run.seq_len) / ms};
}

// Waits for the asynchronous save in flight, if any (raising its error), and logs it.
void finish_checkpoint(const Run& run) {
  const auto done = hp::checkpoint::finish();
  if (done && run.log) {
    std::printf("checkpoint %s: written in the background in %.2f s (writer CPU %.2f s)\n",
                done->path.c_str(), done->background_seconds, done->background_cpu_seconds);
    std::fflush(stdout);
  }
}

void save_checkpoint(const Run& run, const hp::checkpoint::State& state, int64_t step) {
  const bool async = run.options.async_checkpoint();
  if (async) finish_checkpoint(run);
  const auto s0 = std::chrono::steady_clock::now();
  const auto saved = hp::checkpoint::save(run.options.checkpoint_dir(), state,
                                          hp::checkpoint::SaveOptions().step(step).asynchronous(async));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
  if (run.log) {
    const double mb = static_cast<double>(saved.total_bytes) / 1e6;
    if (async) {
      std::printf("checkpoint %s: %.1f MB, training stalled %.3f s (snapshot; writing in the background)\n",
                  saved.path.c_str(), mb, seconds);
    } else {
      std::printf("checkpoint %s: %.1f MB in %.2f s (%.1f MB/s)\n", saved.path.c_str(), mb, seconds,
                  mb / std::max(seconds, 1e-9));
    }
    std::fflush(stdout);
  }
}

}  // namespace

std::vector<StepResult> train(const TrainOptions& options,
                              const std::function<void(int64_t, TransformerImpl&)>& inspect) {
  const Run run = make_run(options);
  auto model = build_model(run);
  std::shared_ptr<hp::data_parallel::GradientReducer> reducer;  // averages gradients over dp
  if (run.dp_mesh && !options.fully_shard()) reducer = hp::data_parallel::data_parallel(*model, *run.dp_mesh);
  torch::optim::AdamW optimizer(
      model->parameters(),
      torch::optim::AdamWOptions(options.lr()).weight_decay(options.weight_decay()).betas({0.9, 0.95}));
  if (run.log) print_banner(run);
  // The checkpoint state aliases the model's and the optimizer's tensors: a save writes their
  // current values, a load writes into them.
  hp::checkpoint::State state;
  if (!options.checkpoint_dir().empty()) {
    state = hp::checkpoint::model_state(*model);
    hp::checkpoint::add_optimizer_state(state, optimizer, *model);
  }
  const int64_t first_step = resume(run, state);
  std::vector<StepResult> results;
  const auto world = hp::comm::world();
  for (int64_t step = first_step; step <= options.steps(); ++step) {
    hp::comm::maybe_kill_at_step(step);
    const auto r = train_step(run, *model, optimizer, step, inspect);
    results.push_back(r);
    if (run.log) {
      std::printf("step %3lld | loss %8.4f | grad norm %7.3f | tokens/s %9.0f | ms/step %8.1f\n",
                  static_cast<long long>(step), r.loss, r.grad_norm, r.tokens_per_s, r.ms);
      std::fflush(stdout);
    }
    const int64_t every = options.checkpoint_every();
    const bool saved = every > 0 && (step % every == 0 || step == options.steps());
    if (saved) save_checkpoint(run, state, step);
    // A preemption notice (hp-run's SIGUSR1): every rank stops after the same step, with a
    // checkpoint of it. The reference computes alone on each rank: its own notice decides.
    const bool preempted =
        step < options.steps() &&
        (options.reference() ? hp::comm::preemption_requested() : hp::comm::agree_on_preemption(world));
    if (preempted) {
      if (!saved && !options.checkpoint_dir().empty()) save_checkpoint(run, state, step);
      finish_checkpoint(run);  // published before hp-run hears of it
      if (run.log) {
        if (options.checkpoint_dir().empty()) {
          std::printf("hp-preempted: no checkpoint (no checkpoint_dir); stopped after step %lld\n",
                      static_cast<long long>(step));
        } else {
          std::printf("hp-preempted: checkpoint at step %lld\n", static_cast<long long>(step));
        }
        std::fflush(stdout);
      }
      break;
    }
  }
  finish_checkpoint(run);
  return results;
}

}  // namespace llama3
