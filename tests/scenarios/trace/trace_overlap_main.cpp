// Runs, with HP_TRACE set, the two fused MC2 ops and a serial control (all_gather, then the
// matmul) a few times on 2 ranks, so that trace_overlap.sh can read the traces: the fused ops'
// transfers must be covered by matmuls, the control's must not. Also the column Linear's fused
// backward, whose reduce-scatter must be covered by its weight gradient (spans "wgrad"), and a
// serial control that computes the weight gradient after the reduce-scatter. With an argument,
// the row chain below instead (deferred weight gradients in a gather window, or not), or an
// agreement started beside a gather in flight.
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
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

// `trace_overlap_main agreement`: a large all-gather in flight, then a second one started with
// its per-op agreement, then an embedding's row gather (blocking). The agreement's messages and
// the row gather travel on the control channel's own connections, so each returns while the
// first gather's payload is still on the link; on one connection per peer they queued behind
// that payload, and the first gather was complete by then (on one rank in one instance of three,
// its completion was marked late). Prints how often it was still in flight.
int agreement_beside_payload() {
  auto group = hp::comm::world();
  const int64_t p = group.size();
  const auto payload = at::ones({int64_t{16} << 20});  // 64 MiB per rank: 0.5 s at 1 Gbit/s
  const auto small = at::ones({16});
  // This rank's rows of a [64 P, 256] table: row i of the whole table holds i.
  const auto table =
      (at::arange(64, at::kFloat) + 64 * group.rank()).unsqueeze(1).expand({64, 256}).contiguous();
  const auto ids = at::arange(64 * p, at::kLong);
  hp::comm::barrier(group);  // the control channel's connections are made here
  // The completion thread marks a gather complete shortly after its last transfer: give it that
  // time, a fraction of the 0.5 s the payload takes, so that only a gather in flight reads so.
  auto in_flight = [](hp::comm::PendingAllGather& large) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return !large.is_completed();
  };
  int started = 0, rows = 0;
  for (int i = 0; i < 3; ++i) {
    auto large = hp::comm::start_all_gather(payload, group);
    auto next = hp::comm::start_all_gather(small, group);
    started += in_flight(large) ? 1 : 0;
    large.wait();
    next.wait();
    large = hp::comm::start_all_gather(payload, group);
    const auto gathered = hp::comm::gather_rows(table, 64 * p, ids, group);
    rows += in_flight(large) ? 1 : 0;
    if (!gathered.equal(ids.to(at::kFloat).unsqueeze(1).expand({64 * p, 256}))) {
      std::printf("rank %lld: the row gather returned other rows\n", static_cast<long long>(group.rank()));
      return 1;
    }
    large.wait();
    hp::comm::barrier(group);
  }
  std::printf("rank %lld: agreements beside payload in flight: %d of 3; row gathers: %d of 3\n",
              static_cast<long long>(group.rank()), started, rows);
  hp::comm::destroy_process_group();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  hp::comm::init_process_group();
  if (argc > 1 && std::string(argv[1]) == "agreement") return agreement_beside_payload();
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
