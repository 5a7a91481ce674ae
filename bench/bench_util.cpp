#include "bench_util.h"

#include <malloc.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>

#include <ATen/ATen.h>
#include <c10/util/C++17.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/p2p.h>

namespace bench {

double model_state_bytes(const torch::nn::Module& model,
                         const std::vector<torch::optim::AdamW*>& optimizers) {
  double bytes = 0;
  const auto count = [&](const at::Tensor& t) {
    if (t.defined()) bytes += static_cast<double>(t.storage().nbytes());
  };
  for (const auto& p : model.parameters()) {
    count(p);
    count(p.grad());
    for (auto* optimizer : optimizers) {
      auto it = optimizer->state().find(c10::guts::to_string(p.unsafeGetTensorImpl()));
      if (it == optimizer->state().end()) continue;
      const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
      count(s.exp_avg());
      count(s.exp_avg_sq());
      count(s.max_exp_avg_sq());
    }
  }
  return bytes;
}

namespace comm = hyper_parallel::comm;

double process_cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec);
  };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

void keep_freed_memory() {
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

Stats slowest(std::vector<double> seconds, const comm::Group& group) {
  std::sort(seconds.begin(), seconds.end());
  auto local =
      at::tensor({seconds[seconds.size() / 2], seconds.front(), seconds.back()}, at::kDouble).unsqueeze(0);
  const auto worst = std::get<0>(comm::all_gather(local, 0, group).max(0));  // [P, 3] -> [3]
  return {worst[0].item<double>(), worst[1].item<double>(), worst[2].item<double>()};
}

Stats time_calls(const comm::Group& group, int iters, const std::function<void()>& fn) {
  return interleaved(group, iters, {fn}).front();
}

std::vector<Stats> interleaved(const comm::Group& group, int iters,
                               const std::vector<std::function<void()>>& variants) {
  for (const auto& fn : variants) fn();
  std::vector<std::vector<double>> times(variants.size());
  for (int i = 0; i < iters; ++i) {
    for (size_t v = 0; v < variants.size(); ++v) {
      comm::barrier(group);
      const auto t0 = std::chrono::steady_clock::now();
      variants[v]();
      times[v].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  std::vector<Stats> out;
  for (auto& t : times) out.push_back(slowest(std::move(t), group));
  return out;
}

NeighbourStream::NeighbourStream(const comm::Group& group, int64_t messages, int64_t elems)
    : group_(group), messages_(std::max<int64_t>(1, messages)), elems_(elems) {
  out_ = at::zeros({elems_}, at::kBFloat16);
  for (int64_t i = 0; i < messages_; ++i) in_.push_back(at::empty({elems_}, at::kBFloat16));
}

void NeighbourStream::run() const {
  const int64_t p = group_.size(), r = group_.rank();
  auto tags = comm::reserve_tags(group_);
  std::vector<comm::Work> works;
  for (int64_t i = 0; i < messages_; ++i)
    works.push_back(comm::irecv(in_[i], (r + p - 1) % p, group_, tags.step(i)));
  for (int64_t i = 0; i < messages_; ++i)
    works.push_back(comm::isend(out_, (r + 1) % p, group_, tags.step(i)));
  for (auto& w : works) w.wait();
}

std::string link_name() {
  const char* link = std::getenv("HP_BENCH_LINK");
  return link ? link : "loopback (TCP costs CPU on the same cores as the matmuls)";
}

std::string rate_command() {
  const char* cmd = std::getenv("HP_BENCH_RATE_CMD");
  return cmd ? cmd : "";
}

void set_rate(const char* program, const std::string& command, const std::string& rate,
              const comm::Group& group) {
  const int rc = std::system((command + " " + rate).c_str());
  TORCH_CHECK(rc == 0, program, ": the rate command '", command, " ", rate, "' failed (", rc, ")");
  comm::barrier(group);
}

}  // namespace bench
