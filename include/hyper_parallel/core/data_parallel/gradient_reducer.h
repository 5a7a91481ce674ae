#pragma once
// GradientReducer: averages the gradients of a set of parameters over a data-parallel group,
// in buckets whose all-reduces run while the backward goes on (as DDP does):
//   - the parameters are laid out in buckets of at most `bucket_cap_bytes` (the first one of at
//     most `first_bucket_cap_bytes`, the next ones growing from it, the last ones shrinking
//     toward the backward's end), one dtype
//     each, in reverse order (the order a backward produces their gradients);
//   - a hook on each parameter's gradient accumulator marks it ready; bucket b is started
//     (comm::start_all_reduce; start_row_sparse_all_reduce for a row_sparse_parameters entry, a
//     bucket alone) once its gradients and those of buckets 0..b-1 are all ready, so
//     every rank starts the same buckets in the same order whatever its graph's timing;
//   - after the first backward that reduces, the buckets are laid out again in the order it
//     produced the gradients (rank 0's, broadcast once; DDP's bucket rebuild);
//   - the autograd engine's final callback of that backward starts the buckets still waiting
//     (a parameter without a gradient contributes zeros) and waits for all of them, so the
//     gradients are averaged when backward() returns: an optimizer step may follow at once.
// The bucket buffers are kept from one backward to the next (one gradient's worth of memory, as
// DDP's), so no step page-faults them in again.
// A parameter that got no gradient on any rank keeps its .grad (undefined stays undefined); one
// that got it on some ranks only gets the average on all of them.
//
// The ranks agree on the bucket layout once, at construction (a rank that builds another layout
// gets an error there, not a hang); the per-bucket all-reduces then start without a round trip.
//
// Contract: all ranks of the group construct their reducers in the same order, and run the same
// backward passes (the same number, with or without no_sync) on them.

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <hyper_parallel/core/comm/process_group.h>

namespace hyper_parallel::data_parallel {

/// Usage:
///   GradientReducer reducer(params, mesh["dp"].get_group(),
///                           GradientReducerOptions().bucket_cap_bytes(8 << 20));
struct GradientReducerOptions {
  /// Largest bucket, in bytes of gradient (DDP's default, 25 MiB).
  TORCH_ARG(int64_t, bucket_cap_bytes) = int64_t{25} << 20;
  /// Largest first bucket (the last layers' gradients, ready first): small, so the link starts
  /// early in the backward (DDP's default, 1 MiB). A parameter larger than a cap is a bucket alone.
  TORCH_ARG(int64_t, first_bucket_cap_bytes) = int64_t{1} << 20;
  /// true: the first buckets grow: a bucket holds no more than the buckets before it together
  /// (at least first_bucket_cap_bytes), so they double up to bucket_cap_bytes. On a link slower
  /// than the backward, each bucket then fills while the link is still busy with the ones before
  /// it, and the link never waits for a full cap of gradients (the last layer's, say) to be
  /// produced. false: DDP's layout, one small first bucket, then full caps.
  TORCH_ARG(bool, grow_first_buckets) = true;
  /// true: the last buckets (the first layers' gradients, ready at the backward's end) shrink: a
  /// bucket holds no more than the gradients the backward produces after it (at least
  /// first_bucket_cap_bytes). The last bucket waits for the backward's end with nothing left to
  /// hide its transfer behind, and the one before it for the little compute left. Counted in
  /// bytes (the parameters before it in model order) until the buckets are rebuilt, then in
  /// time: the share of the first backward still to run when its last gradient was ready, times
  /// all the gradient bytes. false: DDP's layout, every bucket up to bucket_cap_bytes.
  TORCH_ARG(bool, shrink_last_buckets) = true;
  /// true: after the first backward that reduces, the buckets are laid out again (same caps) in
  /// the order that backward made the gradients ready, rank 0's (DDP's bucket rebuild). false:
  /// reverse parameter order for good.
  TORCH_ARG(bool, rebuild_buckets) = true;
  /// true: buckets reduce while the backward goes on. false: each bucket is reduced, blocking,
  /// when it is ready (the same arithmetic, bitwise; for comparison).
  TORCH_ARG(bool, overlap) = true;
  /// true: once reduced, each .grad is a tensor on its bucket's buffer (DDP's
  /// gradient_as_bucket_view), so the next backward accumulates into the bucket in place: no copy
  /// into the bucket before its all-reduce, none back into .grad after it. A .grad replaced
  /// or set to none between steps is copied in, as with false. Differences: .grad is a new
  /// tensor after the first reduced backward (a reference taken before it is not updated; the
  /// rebuild moves the gradients with the buckets then, not later), and after a failed backward
  /// the gradients hold unspecified values (zero them or set them to none before the next one).
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// Parameters (among `params`) whose gradients are mostly all-zero rows: an embedding's, which
  /// only has the rows of the tokens a step saw. Each gets a bucket of its own, reduced by
  /// comm::start_row_sparse_all_reduce: where the busiest rank's nonzero rows are fewer bytes
  /// than a dense all-reduce moves, only they travel; the result is bitwise the dense one's.
  /// data_parallel(module, ...) adds the weights of the module's Embedding modules (see
  /// row_sparse_embeddings).
  TORCH_ARG(std::vector<at::Tensor>, row_sparse_parameters) = {};
  /// data_parallel(module, ...) only: true adds the weights of the module's Embedding modules to
  /// row_sparse_parameters. false leaves them dense: for an embedding whose gradient has every
  /// row (a weight tied to the output projection), which the row-sparse op would only find out
  /// after a round trip of counts.
  TORCH_ARG(bool, row_sparse_embeddings) = true;
};

class GradientReducer {
 public:
  /// `params`: the parameters to average (those not requiring grad are skipped, repeats are
  /// counted once). Registers the hooks; the destructor removes them.
  GradientReducer(const std::vector<at::Tensor>& params, comm::Group group,
                  const GradientReducerOptions& options = {});
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  /// While sync is off, backward passes only accumulate gradients locally; the first backward
  /// with sync on averages the accumulated sums (gradient accumulation, DDP's no_sync).
  void set_sync(bool sync);
  bool sync() const;

  /// Bucket b's parameters, as indices into the parameters kept (reverse order, then the first
  /// reducing backward's order once rebuilt).
  std::vector<std::vector<int64_t>> bucket_parameters() const;
  /// The parameters kept: `params` without repeats and frozen ones, in their order.
  const std::vector<at::Tensor>& parameters() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

/// Turns sync off while it lives (GradientReducer::set_sync), restoring the previous setting.
///
/// Usage:
///   { NoSyncGuard no_sync(*reducer); loss1.backward(); }  // accumulate only
///   loss2.backward();                                       // averages the sum
class NoSyncGuard {
 public:
  explicit NoSyncGuard(GradientReducer& reducer) : reducer_(reducer), previous_(reducer.sync()) {
    reducer_.set_sync(false);
  }
  ~NoSyncGuard() { reducer_.set_sync(previous_); }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;

 private:
  GradientReducer& reducer_;
  bool previous_;
};

}  // namespace hyper_parallel::data_parallel
