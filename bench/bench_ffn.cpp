// The Llama 3 feed-forward block (w2(silu(w1 x) * w3 x)) under TP + SP, unfused vs MC2, forward
// and forward+backward, timed side by side in one run (interleaved) on the same ranks and shards.
//   bash bench/run_bench.sh bench_ffn [RATE] 2 -- [--dim 1024] [--hidden 2816] [--tokens 2048]
#include <cstdio>
#include <memory>

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include <hyper_parallel/hyper_parallel.h>

#include "bench_util.h"
#include "common/run_main.h"
#include "llama3/model.h"

namespace hp = hyper_parallel;
namespace tp = hp::tensor_parallel;
using hp::dtensor::Replicate;
using hp::dtensor::Shard;

namespace {

struct Sizes {
  int64_t dim = 1024, hidden = 2816, tokens = 2048, batch = 8;
  int iters = 5;
};

llama3::FeedForward make(bool mc2, const Sizes& s, const hp::dtensor::DeviceMesh& mesh) {
  at::manual_seed(1);
  llama3::FeedForward ffn(s.dim, s.hidden);
  ffn->to(at::kBFloat16);
  if (mc2) {
    tp::parallelize_module(*ffn, mesh,
                           {{"w1", std::make_shared<tp::MC2ColwiseParallel>()},
                            {"w3", std::make_shared<tp::MC2ColwiseParallel>()},
                            {"w2", std::make_shared<tp::MC2RowwiseParallel>()}});
    return ffn;
  }
  tp::parallelize_module(
      *ffn, mesh,
      {{"",
        std::make_shared<tp::PrepareModuleInput>(
            tp::PrepareModuleInputOptions().input_layouts({Shard(1)}).desired_input_layouts({Replicate()}))},
       {"w1", std::make_shared<tp::ColwiseParallel>()},
       {"w3", std::make_shared<tp::ColwiseParallel>()},
       {"w2", std::make_shared<tp::RowwiseParallel>(tp::RowwiseParallelOptions().output_layouts(Shard(1)))}});
  return ffn;
}

// Forward and forward+backward of both blocks, interleaved: {fwd plain, fwd MC2, step plain, step MC2}.
std::vector<bench::Stats> measure(const Sizes& s, const hp::dtensor::DeviceMesh& mesh) {
  auto plain = make(false, s, mesh), fused = make(true, s, mesh);
  at::manual_seed(2 + hp::comm::global_rank());
  auto x = at::randn({s.batch, s.tokens / s.batch / mesh.size(0), s.dim}).to(at::kBFloat16);
  auto forward = [&](llama3::FeedForward& m) {
    return [&m, &x] {
      at::NoGradGuard no_grad;
      m(x);
    };
  };
  auto step = [&](llama3::FeedForward& m) {
    return [&m, &x] { m(x.clone().requires_grad_(true)).sum().backward(); };
  };
  return bench::interleaved(mesh.get_group(0), s.iters,
                            {forward(plain), forward(fused), step(plain), step(fused)});
}

void report(const Sizes& s, int64_t p, const std::vector<bench::Stats>& t) {
  std::printf(
      "Llama FFN block, %lld ranks, bf16, dim %lld, hidden %lld, %lld tokens (%lld per rank), median of %d "
      "(interleaved), link: %s\n",
      static_cast<long long>(p), static_cast<long long>(s.dim), static_cast<long long>(s.hidden),
      static_cast<long long>(s.tokens), static_cast<long long>(s.tokens / p), s.iters,
      bench::link_name().c_str());
  std::printf("%-18s %10s %10s %9s\n", "", "unfused ms", "MC2 ms", "speedup");
  std::printf("%-18s %10.1f %10.1f %8.2fx\n", "forward", t[0].median * 1e3, t[1].median * 1e3,
              t[0].median / t[1].median);
  std::printf("%-18s %10.1f %10.1f %8.2fx\n", "forward+backward", t[2].median * 1e3, t[3].median * 1e3,
              t[2].median / t[3].median);
}

}  // namespace

int main(int argc, char** argv) {
  Sizes s;
  CLI::App app("The Llama 3 feed-forward block, unfused vs MC2, side by side.", "bench_ffn");
  app.add_option("--dim", s.dim, "model dim")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--hidden", s.hidden, "FFN hidden dim")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--tokens", s.tokens, "tokens per step, all ranks")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--iters", s.iters, "rounds per variant (median)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  return hp_examples::run_main("bench_ffn", [&] {
    bench::keep_freed_memory();
    hp::comm::init_process_group();
    const int64_t p = hp::comm::world_size();
    auto mesh = hp::dtensor::init_device_mesh("cpu", {p}, {"tp"});
    const auto times = measure(s, mesh);
    if (hp::comm::global_rank() == 0) report(s, p, times);
    hp::comm::destroy_process_group();
    return 0;
  });
}
