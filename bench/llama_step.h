#pragma once
// bench_llama_step's configurations, models and results, shared by the program and its report.

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/optim/adamw.h>

#include <hyper_parallel/hyper_parallel.h>

#include "bench_util.h"
#include "llama3/model.h"
#include "llama3/parallelize.h"

namespace llama_step {

namespace hp = hyper_parallel;

enum class GradientSync { kNone, kBlocking, kOverlapped, kFullyShard };

struct Config {
  std::string name;
  bool mc2;
  llama3::MC2Scope scope;
  GradientSync dp = GradientSync::kNone;
  bool defer_weight_grads = true;  // MC2Options::defer_weight_grads
  bool ddp_layout = false;         // no grow_first_buckets, no shrink_last_buckets, no row-sparse embedding
  bool reshard_after_forward = true;  // kFullyShard
  bool split_root = false;  // kFullyShard: the embedding and the output layer in groups of their own
  // kFullyShard (with split_root): one optimizer per group, stepped in the forward's order, and the
  // groups that the forward needs before its first block has computed (the root, the embedding and
  // block 0) gather for the next step as soon as their own step is done, beside the others' steps.
  bool early_gather = false;
  // kFullyShard: one reduce-scatter per group once its whole backward is over, not buckets that
  // leave as its gradients come (reduce_bucket_cap_bytes 0).
  bool fused_reduce = false;
  // kFullyShard (with early_gather): as a training loop runs, every group but a row-sparse
  // embedding gathers right after its own step and the step does not wait for these gathers: the
  // next step's forward finds them in flight. Timed after an untimed step of the same
  // configuration with no barrier between the two, and its gathers waited for (untimed) before
  // another configuration's step.
  bool steady = false;
};

// The meshes: TP over the world, or {dp, tp}.
struct Meshes {
  hp::dtensor::DeviceMesh tp;
  std::optional<hp::dtensor::DeviceMesh> dp;
  hp::comm::Group world;
  int64_t replica() const { return dp ? dp->get_local_rank(0) : 0; }
  int64_t replicas() const { return dp ? dp->size(0) : 1; }
};

// One optimizer of a configuration and, with early_gather, the group it steps when that group
// gathers right after its step.
struct OptimizerStep {
  std::unique_ptr<torch::optim::AdamW> optimizer;
  std::optional<hp::fully_shard::FSDPModule> gather_after;
};

// One configuration's model and optimizers (one, or one per group with early_gather, stepped in
// order).
struct Run {
  llama3::Transformer model{nullptr};
  std::vector<OptimizerStep> optimizers;
  std::shared_ptr<hp::data_parallel::GradientReducer> reducer;
};

// One configuration's result at one rate: the slowest rank's step statistics, its compute-only
// twin's median (whole step and by phase), the payload bytes a rank sends per step (forward,
// backward) and the peak RSS over its steps.
struct Measured {
  bench::Stats step;
  double compute = 0, compute_forward = 0, compute_backward = 0, compute_optimizer = 0;
  int64_t bytes = 0, forward_bytes = 0, backward_bytes = 0, optimizer_bytes = 0;
  double peak_rss_mb = 0;
  double state_mb = 0;  // this rank's parameters, gradients and AdamW state, from their storages
  double transport_cpu_ms_per_mb = 0;  // (step CPU - compute-only CPU) / MB sent, median
  std::map<std::pair<std::string, std::string>, double> waits;  // rank 0's mean per step
};

struct Bench {
  std::vector<Config> configs;
  std::vector<Run> real, compute_only;
  llama3::ModelArgs args;
  int64_t seq_len = 0, batch_size = 0;
  int steps = 0, warmup = 0;
  double bucket_mb = 25;   // data_parallel's bucket cap
  int64_t step_index = 0;  // the data of every step differs, across rates too
};

}  // namespace llama_step
