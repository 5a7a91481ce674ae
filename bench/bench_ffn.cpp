// The Llama 3 feed-forward block (w2(silu(w1 x) * w3 x)) under TP + SP, unfused vs MC2, forward
// and forward+backward, timed side by side in one run on the same ranks and shards.
//   bash bench/run_bench.sh bench_ffn [RATE] 2 -- [--dim 1024] [--hidden 2816] [--tokens 2048]
#include <cstdio>
#include <string>

#include <ATen/ATen.h>

#include <hyper_parallel/hyper_parallel.h>

#include "bench_util.h"
#include "llama3/model.h"

namespace hp = hyper_parallel;
namespace tp = hp::tensor_parallel;
using hp::dtensor::Replicate;
using hp::dtensor::Shard;

int main(int argc, char** argv) {
  int64_t dim = 1024, hidden = 2816, tokens = 2048, batch = 8;
  int iters = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const int64_t v = std::stoll(argv[i + 1]);
    if (a == "--dim") dim = v;
    else if (a == "--hidden") hidden = v;
    else if (a == "--tokens") tokens = v;
    else if (a == "--iters") iters = static_cast<int>(v);
    else {
      std::fprintf(stderr, "usage: bench_ffn [--dim N] [--hidden N] [--tokens N] [--iters N]\n");
      return 2;
    }
  }
  bench::keep_freed_memory();
  hp::comm::init_process_group();
  const int64_t p = hp::comm::world_size();
  auto mesh = hp::dtensor::init_device_mesh("cpu", {p}, {"tp"});
  auto group = mesh.get_group(0);
  auto make = [&](bool mc2) {
    at::manual_seed(1);
    llama3::FeedForward ffn(dim, hidden);
    ffn->to(at::kBFloat16);
    if (mc2) {
      tp::parallelize_module(*ffn, mesh,
                             {{"w1", std::make_shared<tp::MC2ColwiseParallel>()},
                              {"w3", std::make_shared<tp::MC2ColwiseParallel>()},
                              {"w2", std::make_shared<tp::MC2RowwiseParallel>()}});
    } else {
      tp::parallelize_module(
          *ffn, mesh,
          {{"", std::make_shared<tp::PrepareModuleInput>(tp::PrepareModuleInputOptions()
                                                             .input_layouts({Shard(1)})
                                                             .desired_input_layouts({Replicate()}))},
           {"w1", std::make_shared<tp::ColwiseParallel>()},
           {"w3", std::make_shared<tp::ColwiseParallel>()},
           {"w2", std::make_shared<tp::RowwiseParallel>(tp::RowwiseParallelOptions().output_layouts(Shard(1)))}});
    }
    return ffn;
  };
  auto plain = make(false), fused = make(true);
  at::manual_seed(2 + hp::comm::global_rank());
  const int64_t seq_local = tokens / batch / p;
  auto x = at::randn({batch, seq_local, dim}).to(at::kBFloat16);
  auto time_fwd = [&](llama3::FeedForward& m) {
    return bench::median_seconds(group, iters, [&] {
      at::NoGradGuard g;
      m(x);
    });
  };
  auto time_step = [&](llama3::FeedForward& m) {
    return bench::median_seconds(group, iters, [&] {
      auto xi = x.clone().requires_grad_(true);
      m(xi).sum().backward();
    });
  };
  const double f_plain = time_fwd(plain), f_fused = time_fwd(fused);
  const double s_plain = time_step(plain), s_fused = time_step(fused);
  if (hp::comm::global_rank() == 0) {
    std::printf("Llama FFN block, %lld ranks, bf16, dim %lld, hidden %lld, %lld tokens (%lld per rank), link: %s\n",
                static_cast<long long>(p), static_cast<long long>(dim), static_cast<long long>(hidden),
                static_cast<long long>(tokens), static_cast<long long>(tokens / p), bench::link_name().c_str());
    std::printf("%-18s %10s %10s %9s\n", "", "unfused ms", "MC2 ms", "speedup");
    std::printf("%-18s %10.1f %10.1f %8.2fx\n", "forward", f_plain * 1e3, f_fused * 1e3, f_plain / f_fused);
    std::printf("%-18s %10.1f %10.1f %8.2fx\n", "forward+backward", s_plain * 1e3, s_fused * 1e3, s_plain / s_fused);
  }
  hp::comm::destroy_process_group();
  return 0;
}
