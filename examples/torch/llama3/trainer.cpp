#include "trainer.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include <ATen/ATen.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <hyper_parallel/checkpoint.h>
#include <hyper_parallel/core/comm.h>
#include <hyper_parallel/core/dtensor.h>
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

std::vector<StepResult> train(const TrainOptions& options,
                              const std::function<void(int64_t, TransformerImpl&)>& inspect) {
  const auto args = options.model_args().value_or(ModelArgs::from_preset(options.preset()));
  const int64_t seq_len = options.seq_len().value_or(args.max_seq_len);
  TORCH_CHECK(options.dtype() == "fp32" || options.dtype() == "bf16",
              "llama3::train: expected dtype 'fp32' or 'bf16', got '", options.dtype(), "'");
  const auto dtype = options.dtype() == "bf16" ? at::kBFloat16 : at::kFloat;
  const std::string& checkpoint_dir = options.checkpoint_dir();
  TORCH_CHECK(options.checkpoint_every() >= 0, "llama3::train: expected checkpoint_every >= 0, got ",
              options.checkpoint_every());
  TORCH_CHECK(!checkpoint_dir.empty() || (options.checkpoint_every() == 0 && !options.resume()),
              "llama3::train: expected a checkpoint_dir with checkpoint_every or resume");
  auto tp_mesh = hp::dtensor::init_device_mesh("cpu", {hp::comm::world_size()}, {"tp"});
  const bool log = options.log() && hp::comm::global_rank() == 0;
  const int64_t tp_size = options.reference() ? 1 : tp_mesh.size(0);

  at::manual_seed(options.seed());  // full weights, identical on every rank and TP degree
  Transformer model(args);
  model->to(dtype);
  if (!options.reference()) {
    parallelize_llama3(*model, tp_mesh,
                       ParallelizeOptions()
                           .enable_sequence_parallel(options.enable_sequence_parallel())
                           .enable_loss_parallel(options.enable_loss_parallel())
                           .enable_mc2(options.enable_mc2())
                           .mc2_scope(mc2_scope_from_string(options.mc2_scope()))
                           .mc2_contract(options.relaxed_mc2_contract()
                                             ? hp::tensor_parallel::MC2Contract::relaxed()
                                             : hp::tensor_parallel::MC2Contract::strict())
                           .mc2_options(hp::tensor_parallel::MC2Options().chunks_per_rank(
                               options.mc2_chunks_per_rank()))
                           .seq_len(seq_len));
  }
  torch::optim::AdamW optimizer(model->parameters(),
                                torch::optim::AdamWOptions(options.lr())
                                    .weight_decay(options.weight_decay())
                                    .betas({0.9, 0.95}));
  if (log) {
    const std::string mc2 = options.enable_mc2() && !options.reference() ? "on (" + options.mc2_scope() + ")" : "off";
    std::printf("llama3 %s: %lld layers, dim %lld, TP %lld, SP %s, MC2 %s, loss parallel %s, %s, batch %lld x seq %lld\n",
                options.preset().c_str(), static_cast<long long>(args.n_layers),
                static_cast<long long>(args.dim), static_cast<long long>(tp_size),
                options.enable_sequence_parallel() ? "on" : "off", mc2.c_str(),
                options.enable_loss_parallel() ? "on" : "off", options.dtype().c_str(),
                static_cast<long long>(options.batch_size()), static_cast<long long>(seq_len));
    std::fflush(stdout);
  }
  // The checkpoint state aliases the model's and the optimizer's tensors: a save writes their
  // current values, a load writes into them.
  hp::checkpoint::State state;
  if (!checkpoint_dir.empty()) {
    state = hp::checkpoint::model_state(*model);
    hp::checkpoint::add_optimizer_state(state, optimizer, *model);
  }
  int64_t first_step = 1;
  if (options.resume()) {
    const auto latest = hp::checkpoint::latest_step(checkpoint_dir);
    TORCH_CHECK(latest.has_value(), "llama3::train: expected a checkpoint to resume from in '",
                checkpoint_dir, "', got none (no 'latest' file)");
    const std::string dir = hp::checkpoint::step_dir(checkpoint_dir, *latest);
    hp::checkpoint::load(dir, state);
    first_step = *latest + 1;
    if (log) {
      std::printf("resumed from step %lld (%s)\n", static_cast<long long>(*latest), dir.c_str());
      std::fflush(stdout);
    }
  }
  std::vector<StepResult> results;
  for (int64_t step = first_step; step <= options.steps(); ++step) {
    auto t0 = std::chrono::steady_clock::now();
    auto batch = synthetic_batch(options.seed(), step, options.batch_size(), seq_len, args.vocab_size);
    auto inputs = batch.narrow(1, 0, seq_len), targets = batch.narrow(1, 1, seq_len);
    optimizer.zero_grad();
    auto logits = model->forward(inputs);
    at::Tensor loss;
    if (options.enable_loss_parallel() && !options.reference()) {
      loss = hp::tensor_parallel::vocab_parallel_cross_entropy(logits, targets, args.vocab_size, tp_mesh);
    } else {
      loss = at::cross_entropy_loss(logits.flatten(0, 1).to(at::kFloat), targets.flatten());
    }
    loss.backward();
    if (inspect) inspect(step, *model);
    const double grad_norm = hp::tensor_parallel::clip_grad_norm_(*model, options.max_norm());
    optimizer.step();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    StepResult r{step, loss.item<double>(), grad_norm, ms,
                 1000.0 * static_cast<double>(options.batch_size() * seq_len) / ms};
    results.push_back(r);
    if (log) {
      std::printf("step %3lld | loss %8.4f | grad norm %7.3f | tokens/s %9.0f | ms/step %8.1f\n",
                  static_cast<long long>(step), r.loss, r.grad_norm, r.tokens_per_s, r.ms);
      std::fflush(stdout);
    }
    const int64_t every = options.checkpoint_every();
    if (every > 0 && (step % every == 0 || step == options.steps())) {
      const auto s0 = std::chrono::steady_clock::now();
      const auto saved = hp::checkpoint::save(checkpoint_dir, state, hp::checkpoint::SaveOptions().step(step));
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
      if (log) {
        const double mb = static_cast<double>(saved.total_bytes) / 1e6;
        std::printf("checkpoint %s: %.1f MB in %.2f s (%.1f MB/s)\n", saved.path.c_str(), mb, seconds,
                    mb / std::max(seconds, 1e-9));
        std::fflush(stdout);
      }
    }
  }
  return results;
}

}  // namespace llama3
