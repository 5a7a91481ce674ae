// Runs, with HP_TRACE set, the two fused MC2 ops and a serial control (all_gather, then the
// matmul) a few times on 2 ranks, so that trace_overlap.sh can read the traces: the fused ops'
// transfers must be covered by matmuls, the control's must not.
#include <cstdio>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm.h>
#include <hyper_parallel/core/tensor_parallel/mc2/ops.h>

namespace hp = hyper_parallel;
namespace tp = hp::tensor_parallel;

int main() {
  hp::comm::init_process_group();
  auto group = hp::comm::world();
  const int64_t p = group.size(), m = 512, k = 4096, n = 4096;
  at::manual_seed(1 + group.rank());
  auto x = at::randn({m, k}).to(at::kBFloat16), xr = at::randn({p * m, k}).to(at::kBFloat16);
  auto w = at::randn({n, k}).to(at::kBFloat16);
  const auto options = tp::MC2Options().chunks_per_rank(4);
  auto serial_control = [&] {
    // The control: every transfer completes before the matmul starts.
    hp::comm::trace::OpSpan control("serial_all_gather_then_matmul");
    auto gathered = hp::comm::all_gather(x, 0, group);
    tp::detail::local_matmul(gathered, w.t());
  };
  {
    // Warm-up (first matmuls, the transport's waiter threads), reported as its own op.
    hp::comm::trace::OpSpan warmup("warmup");
    tp::all_gather_matmul(x, w, group, options);
    tp::matmul_reduce_scatter(xr, w, group, options);
    serial_control();
  }
  for (int i = 0; i < 3; ++i) {
    tp::all_gather_matmul(x, w, group, options);
    tp::matmul_reduce_scatter(xr, w, group, options);
    serial_control();
    hp::comm::barrier(group);
  }
  std::printf("rank %lld done\n", static_cast<long long>(group.rank()));
  hp::comm::destroy_process_group();
  return 0;
}
