// Llama 3 with TP + SP against the single-process reference: same losses and gradient norms over
// 5 AdamW steps, same gradients (fp32) at the first and the last step, loss parallel equal to the
// gathered loss, exact collective counts, and the plan's validation errors.
#include <gtest/gtest.h>

#include <map>
#include <sstream>
#include <string>

#include <ATen/ATen.h>

#include <hyper_parallel/hyper_parallel.h>

#include "common/llama3_grads.h"
#include "common/test_util.h"
#include "llama3/model.h"
#include "llama3/parallelize.h"
#include "llama3/trainer.h"

namespace hp = hyper_parallel;
namespace tp = hp::tensor_parallel;
using hp::comm::CollectiveKind;
using hp_test::expect_close;

namespace {

// fp32 TP reorders sums (ring reductions, sharded matmuls): ~1e-6 relative per op, amplified
// slightly by 5 AdamW steps.
constexpr double kLossRtol = 1e-4;
constexpr double kGradRtol = 1e-3, kGradAtol = 1e-5;

using hp_test::Grads;

std::pair<std::vector<llama3::StepResult>, Grads> run(llama3::TrainOptions options) {
  Grads grads;
  auto results = llama3::train(options.steps(5).log(false), hp_test::gather_grads_at_checked_steps(grads));
  return {results, grads};
}

// The single-process reference depends only on the model, the data and the optimizer, not on
// the parallel plan: each is trained once per process and reused by every plan compared with it.
const std::pair<std::vector<llama3::StepResult>, Grads>& reference_training(const llama3::TrainOptions& o) {
  static std::map<std::string, std::pair<std::vector<llama3::StepResult>, Grads>> cache;
  TORCH_INTERNAL_ASSERT(!o.model_args().has_value(), "the reference is keyed by the preset");
  std::ostringstream key;
  key << o.preset() << ' ' << o.steps() << ' ' << o.batch_size() << ' ' << o.seq_len().value_or(-1) << ' '
      << o.dtype() << ' ' << o.lr() << ' ' << o.weight_decay() << ' ' << o.max_norm() << ' ' << o.seed();
  auto it = cache.find(key.str());
  if (it == cache.end()) {
    hp::comm::reset_collective_counts();
    it = cache.emplace(key.str(), run(llama3::TrainOptions(o).reference(true))).first;
    EXPECT_EQ(hp::comm::total_collective_count(), 0) << "the reference is single-process";
  }
  return it->second;
}

void expect_same_training(const llama3::TrainOptions& options) {
  const auto& [ref, ref_grads] = reference_training(options);
  hp::comm::reset_collective_counts();
  auto [par, par_grads] = run(options);
  // 5 steps, each with the plan's all-gathers (SP) or all-reduces (no SP) in every block; with
  // TP 1 (all ranks data-parallel), the gradient buckets' all-reduces.
  const bool tp = hp_test::world_size() > options.dp();
  const auto kind =
      options.enable_sequence_parallel() && tp ? CollectiveKind::kAllGather : CollectiveKind::kAllReduce;
  EXPECT_GE(hp::comm::collective_count(kind), 5 * (tp ? 2 * llama3::ModelArgs::debug().n_layers : 1))
      << "the run really is parallel: " << hp::comm::collective_counts_summary();
  ASSERT_EQ(ref.size(), par.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_NEAR(par[i].loss, ref[i].loss, kLossRtol * std::abs(ref[i].loss)) << "step " << i + 1;
    EXPECT_NEAR(par[i].grad_norm, ref[i].grad_norm, kGradRtol * ref[i].grad_norm) << "step " << i + 1;
  }
  EXPECT_LT(par.back().loss, par.front().loss) << "the loss falls";
  hp_test::expect_close_grads(par_grads, ref_grads, kGradRtol, kGradAtol);
}

TEST(Llama3, SequenceParallelTrainingEqualsSingleProcess) { expect_same_training(llama3::TrainOptions()); }

TEST(Llama3, TensorParallelWithoutSequenceParallelEqualsSingleProcess) {
  expect_same_training(llama3::TrainOptions().enable_sequence_parallel(false));
}

// Data parallelism: 2 replicas, each with half of the global batch (TP 1 at 2 ranks, TP 2 at 4),
// train like the single-process model over the whole batch; with loss parallel and MC2 too.
TEST(Llama3, DataParallelTimesTensorParallelEqualsSingleProcess) {
  expect_same_training(llama3::TrainOptions().dp(2));
  if (hp_test::world_size() == 4) {
    expect_same_training(
        llama3::TrainOptions().dp(2).enable_loss_parallel(true).enable_mc2(true).relaxed_mc2_contract(true));
  }
}

// fully_shard over the dp dim (each block, then the root): parameters, gradients and AdamW state
// sharded; trains like the single-process model, with the gathered parameters freed after each
// block's forward or kept, with loss parallel and MC2 on every layer (TP 2 at 4 ranks), and as
// HSDP (2 replicas of 2 shards at 4 ranks); bitwise run to run.
TEST(Llama3, FullyShardTimesTensorParallelEqualsSingleProcess) {
  const auto fsdp = llama3::TrainOptions().dp(2).fully_shard(true);
  expect_same_training(fsdp);
  expect_same_training(llama3::TrainOptions(fsdp).reshard_after_forward(false));
  auto [first, g1] = run(fsdp);
  auto [second, g2] = run(fsdp);
  for (size_t i = 0; i < first.size(); ++i) EXPECT_EQ(first[i].loss, second[i].loss) << "step " << i + 1;
  if (hp_test::world_size() == 4) {
    expect_same_training(llama3::TrainOptions(fsdp)
                             .enable_loss_parallel(true)
                             .enable_mc2(true)
                             .mc2_scope("all")
                             .relaxed_mc2_contract(true));
    expect_same_training(llama3::TrainOptions().dp(4).fully_shard(true).hsdp_replicate(2));
  }
}

TEST(Llama3, DataParallelRejectsDegreesThatDoNotDivide) {
  HP_EXPECT_THROW_MSG(llama3::train(llama3::TrainOptions().dp(3).steps(1).log(false)),
                      "llama3::train: expected dp to divide the world size (" +
                          std::to_string(hp_test::world_size()) + "), got 3");
  HP_EXPECT_THROW_MSG(llama3::train(llama3::TrainOptions().dp(2).batch_size(3).steps(1).log(false)),
                      "llama3::train: expected batch_size divisible by dp (2), got 3");
}

TEST(Llama3, LossParallelEqualsGatheredLoss) {
  auto [gathered, g1] = run(llama3::TrainOptions());
  auto [parallel, g2] = run(llama3::TrainOptions().enable_loss_parallel(true));
  for (size_t i = 0; i < gathered.size(); ++i) {
    EXPECT_NEAR(parallel[i].loss, gathered[i].loss, 1e-5 * gathered[i].loss) << "step " << i + 1;
  }
  for (size_t i = 0; i < g1[0].size(); ++i) {
    EXPECT_TRUE(at::allclose(g1[0][i].second, g2[0][i].second, 1e-4, 1e-6)) << g1[0][i].first;
  }
}

TEST(Llama3, SequenceParallelCollectiveCountsPerStep) {
  const int64_t p = hp_test::world_size();
  auto mesh = hp::dtensor::init_device_mesh("cpu", {p}, {"tp"});
  auto args = llama3::ModelArgs::debug();
  at::manual_seed(1);
  llama3::Transformer model(args);
  llama3::parallelize_llama3(*model, mesh);
  auto batch = llama3::synthetic_batch(1, 1, 2, args.max_seq_len, args.vocab_size);
  hp::comm::reset_collective_counts();
  at::Tensor loss;
  {
    hp::comm::CommRegion r("forward");
    auto logits = model(batch.narrow(1, 0, args.max_seq_len));
    loss = at::cross_entropy_loss(logits.flatten(0, 1), batch.narrow(1, 1, args.max_seq_len).flatten());
  }
  {
    hp::comm::CommRegion r("backward");
    loss.backward();
  }
  const int64_t layers = args.n_layers;
  // Forward: per block an all-gather before attention and before the FFN, a reduce-scatter
  // after each; plus the embedding's reduce-scatter, the output's sequence all-gather and the
  // vocabulary all-gather of the logits. Backward mirrors it (the logits' gather backs up to a
  // local slice).
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllGather, "forward"), 2 * layers + 2);
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kReduceScatter, "forward"), 2 * layers + 1);
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kReduceScatter, "backward"), 2 * layers + 1);
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllGather, "backward"), 2 * layers + 1);
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllReduce, "forward"), 0);
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllReduce, "backward"), 0)
      << hp::comm::collective_counts_summary();
  // Norm weights (2 per block + the final one) get their Partial gradients summed.
  EXPECT_EQ(hp::comm::collective_count(CollectiveKind::kAllReduce, "grad_sync"), 2 * layers + 1);
}

// The checklist's transformer (2 layers, dim 16, 4 heads, vocab 8, seq 8) in float64: outputs,
// gradients and parameters after one SGD step equal the single-process model to 1e-10, with and
// without sequence parallelism.
TEST(Llama3, TinyTransformerFloat64EqualsSingleProcess) {
  const int64_t p = hp_test::world_size();
  auto mesh = hp::dtensor::init_device_mesh("cpu", {p}, {"tp"});
  const auto args = llama3::ModelArgs::tiny();
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "with SP" : "without SP");
    auto make = [&] {
      at::manual_seed(21);
      llama3::Transformer m(args);
      m->to(at::kDouble);
      return m;
    };
    auto ref = make();
    auto model = make();
    llama3::parallelize_llama3(*model, mesh, llama3::ParallelizeOptions().enable_sequence_parallel(sp));
    auto batch = llama3::synthetic_batch(5, 1, 2, 8, args.vocab_size);
    auto inputs = batch.narrow(1, 0, 8), targets = batch.narrow(1, 1, 8).flatten();
    auto logits = model(inputs);
    auto ref_logits = ref(inputs);
    EXPECT_TRUE(at::allclose(logits, ref_logits, 1e-10, 1e-10));
    at::cross_entropy_loss(logits.flatten(0, 1), targets).backward();
    at::cross_entropy_loss(ref_logits.flatten(0, 1), targets).backward();
    auto ref_params = ref->named_parameters();
    for (const auto& [name, g] : tp::full_named_parameters(*model, /*gradients=*/true)) {
      EXPECT_TRUE(at::allclose(g, ref_params[name].grad(), 1e-10, 1e-10)) << name;
    }
    at::NoGradGuard no_grad;
    for (auto& t : model->parameters()) t.sub_(t.grad() * 0.1);
    for (auto& t : ref->parameters()) t.sub_(t.grad() * 0.1);
    for (const auto& [name, t] : tp::full_named_parameters(*model)) {
      EXPECT_TRUE(at::allclose(t, ref_params[name], 1e-10, 1e-10)) << name << " after step";
    }
  }
}

TEST(Llama3, PlanValidatesDegreesWithTheNumbers) {
  const int64_t p = hp_test::world_size();
  if (p < 2) GTEST_SKIP() << "needs TP > 1";
  auto mesh = hp::dtensor::init_device_mesh("cpu", {p}, {"tp"});
  auto args = llama3::ModelArgs::debug();
  args.n_heads = 2 * p + 1;
  args.n_kv_heads = 1;
  args.dim = 16 * args.n_heads;
  llama3::Transformer bad_heads(args);
  HP_EXPECT_THROW_MSG(llama3::parallelize_llama3(*bad_heads, mesh),
                      "expected n_heads (" + std::to_string(2 * p + 1) + ") divisible by the TP size (" +
                          std::to_string(p) + ")");
  auto kv = llama3::ModelArgs::debug();
  kv.n_kv_heads = 1;
  llama3::Transformer bad_kv(kv);
  HP_EXPECT_THROW_MSG(llama3::parallelize_llama3(*bad_kv, mesh), "expected n_kv_heads (1) divisible");
  llama3::Transformer model(llama3::ModelArgs::debug());
  HP_EXPECT_THROW_MSG(
      llama3::parallelize_llama3(*model, mesh, llama3::ParallelizeOptions().seq_len(p * 8 + 1)),
      "expected seq_len (" + std::to_string(p * 8 + 1) + ") divisible by the TP size");
}

}  // namespace
