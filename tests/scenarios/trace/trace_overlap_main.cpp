// Runs, with HP_TRACE set, the two fused MC2 ops and a serial control (all_gather, then the
// matmul) a few times on 2 ranks, so that trace_overlap.sh can read the traces: the fused ops'
// transfers must be covered by matmuls, the control's must not. Also the column Linear's fused
// backward, whose reduce-scatter must be covered by its weight gradient (spans "wgrad"), and a
// serial control that computes the weight gradient after the reduce-scatter. With an argument,
// the row chain below instead (deferred weight gradients in a gather window, or not).
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm.h>
#include <hyper_parallel/core/tensor_parallel/mc2/fused_linear.h>
#include <hyper_parallel/core/tensor_parallel/mc2/ops.h>

namespace hp = hyper_parallel;
namespace tp = hp::tensor_parallel;

namespace {

// `trace_overlap_main deferred|serial`: two row Linears in a chain (h -> A -> x -> B), trained
// for a few steps with MC2Options::defer_weight_grads on or off. With it on, B's weight
// gradient runs in A's backward gather window (spans "wgrad" over the "all_gather_matmul"
// transfers); off, it runs in B's own node, in no window and in no wgrad span. Sized so that
// B's dW (m k_b k FLOPs) outlasts A's gather (m k values per rank) and B's own gather is small.
int row_chain(bool deferred) {
  auto group = hp::comm::world();
  const int64_t p = group.size(), m = 512, f = 64, k = 4096, k_b = 1024;
  at::manual_seed(7 + group.rank());
  auto leaf = [](std::vector<int64_t> sizes) {
    return at::randn(sizes).to(at::kBFloat16).requires_grad_(true);
  };
  auto h = leaf({p * m, f}), w_a = leaf({k, f}), w_b = leaf({k_b, k});
  const auto options = tp::MC2Options().chunks_per_rank(2).defer_weight_grads(deferred);
  for (int step = 0; step < 4; ++step) {
    auto x = tp::mc2_row_linear(h, w_a, {}, group, options);  // [m, k]
    auto y = tp::mc2_row_linear(x, w_b, {}, group, options);  // [m / P, k_b]
    y.sum().backward();
    hp::comm::barrier(group);
  }
  std::printf("rank %lld done (%s)\n", static_cast<long long>(group.rank()),
              deferred ? "deferred" : "serial");
  hp::comm::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  hp::comm::init_process_group();
  if (argc > 1) return row_chain(std::string(argv[1]) == "deferred");
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
  // The column backward of a Linear with n_l = n_col output features per rank over the gathered
  // rows G [P m, k]: dX = reduce_scatter(dY W), dW = dYᵀ G. Sized so that a partial's transfer
  // outlasts the matmul that makes it: the weight gradient has something to hide.
  const int64_t n_col = 512;
  auto dy = at::randn({p * m, n_col}).to(at::kBFloat16), gathered = at::randn({p * m, k}).to(at::kBFloat16);
  auto w_col = at::randn({n_col, k}).to(at::kBFloat16);
  auto fused_backward = [&] {
    hp::comm::trace::OpSpan op("column_backward");
    tp::mc2_column_backward(dy, {}, gathered, w_col, group, options, {});
  };
  auto serial_backward = [&] {
    hp::comm::trace::OpSpan op("serial_column_backward");
    tp::matmul_reduce_scatter(dy, w_col.t(), group, options);
    hp::comm::trace::Span span("wgrad");
    at::mm(dy.t(), gathered);
  };
  {
    // Warm-up (first matmuls, the transport's waiter threads), reported as its own op.
    hp::comm::trace::OpSpan warmup("warmup");
    tp::all_gather_matmul(x, w, group, options);
    tp::matmul_reduce_scatter(xr, w, group, options);
    serial_control();
    fused_backward();
    serial_backward();
  }
  for (int i = 0; i < 3; ++i) {
    tp::all_gather_matmul(x, w, group, options);
    tp::matmul_reduce_scatter(xr, w, group, options);
    serial_control();
    fused_backward();
    serial_backward();
    hp::comm::barrier(group);
  }
  // A started all-reduce and a row-sparse one: the transfers their completion thread posts
  // (phase 2; counts, indices and rows) carry their op in the trace, as phase 1's do.
  auto bucket = at::randn({1 << 16}).to(at::kBFloat16);
  hp::comm::start_all_reduce(bucket, hp::comm::ReduceOp::kAvg, group).wait();
  auto rows = at::zeros({64 * 64 + 1}).to(at::kBFloat16);
  rows.narrow(0, 64 * group.rank(), 64).fill_(1);
  hp::comm::start_row_sparse_all_reduce(rows, 64, 64, hp::comm::ReduceOp::kAvg, group).wait();
  std::printf("rank %lld done\n", static_cast<long long>(group.rank()));
  hp::comm::destroy_process_group();
  return 0;
}
