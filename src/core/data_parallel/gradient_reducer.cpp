#include <hyper_parallel/core/nn/pending_gradient.h>
#include <hyper_parallel/core/data_parallel/gradient_reducer.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <unordered_set>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/counters.h>
#include <hyper_parallel/core/comm/pending_all_reduce.h>
#include <hyper_parallel/core/comm/row_sparse_all_reduce.h>

#include "backward_order.h"
#include "bucket_layout.h"
#include "first_layout.h"
#include "../comm/test_hooks.h"

namespace hyper_parallel::data_parallel {

namespace {

// True where `grad` is the bucket's view for it: the backward accumulated into the buffer.
bool is_view_of_bucket(const at::Tensor& grad, const at::Tensor& view) {
  return grad.defined() && grad.data_ptr() == view.data_ptr() && grad.sizes() == view.sizes() &&
         grad.strides() == view.strides();
}

}  // namespace

struct GradientReducer::Impl : std::enable_shared_from_this<GradientReducer::Impl> {
  struct Bucket {
    detail::BucketSpan span;
    int64_t waiting = 0;  // parameters whose gradient this backward has not produced yet
    bool copied_back = false;
    at::Tensor buffer;  // the gradients, then one flag per parameter: 1 where it had a gradient
    // The buffer of the last pass whose reduction was copied back, reused by the next pass: a
    // fresh one would be page-faulted in at every step (DDP keeps its buckets too).
    at::Tensor kept_buffer;
    // gradient_as_bucket_view: each parameter's .grad once reduced, on `buffer`'s storage (the
    // buffer is then kept while this layout stands).
    std::vector<at::Tensor> grad_views;
    comm::PendingAllReduce reduce;
  };

  std::vector<at::Tensor> params;
  comm::Group group;
  GradientReducerOptions options;
  detail::BucketCaps caps;
  std::vector<Bucket> buckets;
  std::vector<int64_t> bucket_of;
  std::vector<bool> ready;
  std::vector<bool> unreached;  // ready because this backward's graph did not reach them
  int64_t next_launch = 0;      // buckets [0, next_launch) have started in this backward
  bool in_backward = false, sync = true;
  detail::BackwardOrder backward_order;  // recorded by each pass until the buckets are rebuilt
  bool rebuilt = false;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;
  std::vector<uintptr_t> hook_keys;

  void install_layout(const std::vector<detail::BucketSpan>& spans);
  void mark_ready(int64_t param, bool record = true);
  void move_gradients_into_buckets();
  void rebuild_buckets();
  void on_gradient(int64_t param);
  void begin_backward();
  void prepare_buffer(Bucket& bucket);
  void start(Bucket& bucket, bool abandoning = false);
  void launch(Bucket& bucket);
  void abandon() noexcept;
  void copy_back(Bucket& bucket);
  void finish_backward();
  void reset();
};

namespace {

// Runs after a parameter's gradient accumulator has written .grad.
class GradientReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  GradientReadyHook(std::weak_ptr<GradientReducer::Impl> reducer, int64_t param)
      : reducer_(std::move(reducer)), param_(param) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (auto reducer = reducer_.lock()) reducer->on_gradient(param_);
    return outputs;
  }

 private:
  std::weak_ptr<GradientReducer::Impl> reducer_;
  int64_t param_;
};

}  // namespace

// At a backward's first gradient: queue the end-of-backward callback, and mark ready the
// parameters this backward's graph does not reach (they get no gradient, and would otherwise
// hold their bucket, and every later one, back until the end).
void GradientReducer::Impl::begin_backward() {
  in_backward = true;
  backward_order.begin_pass();
  // The engine drops its final callbacks unrun when the backward fails: the guard's destructor
  // then abandons this pass (abandon()), so the next backward starts clean instead of finding
  // every flag of this one still set.
  struct PassGuard {
    std::weak_ptr<Impl> reducer;
    bool ran = false;
    ~PassGuard() {
      if (auto impl = reducer.lock(); impl && !ran) impl->abandon();
    }
  };
  auto guard = std::make_shared<PassGuard>();
  guard->reducer = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([guard] {
    guard->ran = true;
    if (auto reducer = guard->reducer.lock()) reducer->finish_backward();
  });
  for (size_t i = 0; i < params.size(); ++i) {
    const auto current = torch::autograd::impl::try_get_grad_accumulator(params[i]);
    TORCH_CHECK_VALUE(current == nullptr || current == accumulators[i],
                      "GradientReducer::on_gradient: expected parameter ", i,
                      " to keep the gradient accumulator it had when the reducer was built, got a ",
                      "new one (its dtype or storage changed after data_parallel); change parameters before "
                      "data_parallel, not after");
  }
  const auto* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (nodes == nullptr || nodes->empty()) return;
  for (size_t i = 0; i < params.size(); ++i) {
    if (nodes->count(accumulators[i].get()) != 0) continue;
    unreached[i] = true;
    mark_ready(static_cast<int64_t>(i), /*record=*/false);
  }
}

// `record`: false for a parameter this backward does not reach; the rebuilt layout puts those
// last, as DDP does (one that a later pass does use would otherwise hold every bucket back).
void GradientReducer::Impl::mark_ready(int64_t param, bool record) {
  ready[param] = true;
  --buckets[bucket_of[param]].waiting;
  if (record && !rebuilt && options.rebuild_buckets()) backward_order.record(param);
}

// After the first backward that reduced, the buckets are laid out again in the order it made the
// parameters ready (DDP's bucket rebuild): a model's registration order need not be its
// backward's (a layer's first projections are registered first but all finish together at its
// end), and a bucket waiting on one late parameter holds every later bucket back. Rank 0's
// order, so that every rank lays out the same buckets. Contract: every rank calls it at the end
// of the same pass (finish_backward or abandon), with no bucket in flight.
void GradientReducer::Impl::rebuild_buckets() {
  if (rebuilt || !options.rebuild_buckets()) return;
  // A benchmark's compute-only twin receives zeros, not rank 0's order: it keeps its layout (the
  // same on every rank; its results are meaningless anyway).
  if (comm::test_hooks::transfers_skipped()) {
    rebuilt = true;
    return;
  }
  auto spans = backward_order.agreed_layout(params, caps, group);
  if (!spans) return;  // rank 0's pass failed: every rank records the next one
  rebuilt = true;
  install_layout(*spans);
  if (options.gradient_as_bucket_view()) move_gradients_into_buckets();
}

// gradient_as_bucket_view: the reduced gradients move into the rebuilt buckets at once, so .grad
// changes identity only at the first reduced backward, and the old buffers are freed.
void GradientReducer::Impl::move_gradients_into_buckets() {
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets) {
    prepare_buffer(bucket);
    for (size_t j = 0; j < bucket.span.params.size(); ++j) {
      auto& grad = params[bucket.span.params[j]].mutable_grad();
      if (!grad.defined()) continue;
      bucket.grad_views[j].copy_(grad);
      grad = bucket.grad_views[j];
    }
  }
}

void GradientReducer::Impl::install_layout(const std::vector<detail::BucketSpan>& spans) {
  buckets.clear();
  bucket_of.assign(params.size(), 0);
  for (const auto& span : spans) {
    for (auto p : span.params) bucket_of[p] = static_cast<int64_t>(buckets.size());
    buckets.emplace_back();
    buckets.back().span = span;
  }
  reset();
}

void GradientReducer::Impl::on_gradient(int64_t param) {
  if (!sync) return;
  // The average is computed outside autograd: a .grad kept with its graph would hold it without
  // the other ranks' part, and a derivative of it (a Hessian-vector product) would be this rank's.
  TORCH_CHECK_NOT_IMPLEMENTED(
      !at::GradMode::is_enabled(),
      "GradientReducer::on_gradient: expected a backward without create_graph, got "
      "create_graph=True (the averaged gradient has no graph); take higher derivatives "
      "with torch.autograd.grad, or inside no_sync");
  if (!in_backward) begin_backward();
  if (ready[param]) {
    TORCH_CHECK_VALUE(
        bucket_of[param] >= next_launch, "GradientReducer::on_gradient: expected one ",
        "accumulation per parameter per backward, reached by the backward's graph, got ",
        unreached[param] ? "a gradient the graph did not show when the backward began (a reentrant "
                           "torch.utils.checkpoint's inner backward: pass use_reentrant=False)"
                         : "a second gradient",
        " for parameter ", param, " (", params[param].sizes(), ") after its bucket had started");
    return;
  }
  mark_ready(param);
  comm::CommRegion region("grad_sync");
  while (next_launch < static_cast<int64_t>(buckets.size()) && buckets[next_launch].waiting == 0) {
    launch(buckets[next_launch++]);
  }
}

// The bucket's buffer for this pass: the kept one, or a new one (and, with
// gradient_as_bucket_view, the gradients' views on it).
void GradientReducer::Impl::prepare_buffer(Bucket& bucket) {
  const auto& span = bucket.span;
  const int64_t numel = span.numel + static_cast<int64_t>(span.params.size());
  const auto tensor_options = params[span.params[0]].options();
  if (options.gradient_as_bucket_view() && bucket.buffer.defined()) return;
  const auto& kept = bucket.kept_buffer;
  bucket.buffer = kept.defined() && kept.numel() == numel && kept.dtype() == tensor_options.dtype()
                      ? std::exchange(bucket.kept_buffer, at::Tensor())
                      : at::empty({numel}, tensor_options);
  if (!options.gradient_as_bucket_view()) return;
  // Tensors on the buffer's storage, not autograd views of it: an optimizer's zero_grad calls
  // detach_() on .grad, which a view refuses.
  bucket.grad_views.clear();
  for (size_t j = 0; j < span.params.size(); ++j) {
    const auto sizes = params[span.params[j]].sizes();
    bucket.grad_views.push_back(
        at::empty({0}, tensor_options)
            .set_(bucket.buffer.storage(), span.offsets[j], sizes, c10::contiguous_strides(sizes)));
  }
}

// Copies the bucket's gradients (zeros and flag 0 where none; nothing where .grad already is the
// bucket's view) and starts its all-reduce.
void GradientReducer::Impl::start(Bucket& bucket, bool abandoning) {
  at::NoGradGuard no_grad;  // the buffer never joins a graph, even under create_graph
  const auto& span = bucket.span;
  prepare_buffer(bucket);
  for (size_t j = 0; j < span.params.size(); ++j) {
    const auto& param = params[span.params[j]];
    // A tensor-parallel sum still in flight joins .grad first. When abandoning, a sum that
    // failed must not keep the remaining buckets from starting (peers would wait for them).
    try {
      nn::finish_gradient(param);
    } catch (const std::exception&) {
      if (!abandoning) throw;
    }
    const auto& grad = param.grad();
    TORCH_CHECK_VALUE(param.numel() == span.numels[j], "GradientReducer::launch: expected parameter ",
                      span.params[j], " to have the ", span.numels[j],
                      " elements laid out at construction, got ", param.sizes(),
                      "; change parameters before data_parallel, not after");
    TORCH_CHECK_TYPE(!grad.defined() || !grad.is_sparse(),
                     "GradientReducer::launch: expected dense gradients, got ", "a sparse one for parameter ",
                     span.params[j]);
    auto slot = bucket.buffer.narrow(0, span.offsets[j], span.numels[j]);
    if (!bucket.grad_views.empty() && is_view_of_bucket(grad, bucket.grad_views[j])) {
      // accumulated in place
    } else if (grad.defined()) {
      slot.view(param.sizes()).copy_(grad);
    } else {
      slot.zero_();
    }
    bucket.buffer[span.numel + static_cast<int64_t>(j)].fill_(grad.defined() ? 1 : 0);
  }
  if (span.row_sparse) {
    const auto& param = params[span.params[0]];
    const int64_t rows = param.dim() == 0 ? 1 : param.size(0);
    bucket.reduce =
        comm::start_row_sparse_all_reduce(bucket.buffer, rows, rows == 0 ? 0 : param.numel() / rows,
                                          comm::ReduceOp::kAvg, group, comm::Agreement::kAgreedInAdvance);
  } else {
    bucket.reduce =
        comm::start_all_reduce(bucket.buffer, comm::ReduceOp::kAvg, group, comm::Agreement::kAgreedInAdvance);
  }
}

void GradientReducer::Impl::launch(Bucket& bucket) {
  start(bucket);
  if (!options.overlap()) copy_back(bucket);
}

// A pass whose backward failed: its remaining buckets are started all the same and waited for
// (their results are dropped), so every pass uses as many tag blocks on every rank, whichever
// bucket each rank's failure stopped at, and peers whose backward succeeded are not left waiting.
void GradientReducer::Impl::abandon() noexcept {
  try {
    comm::CommRegion region("grad_sync");
    while (next_launch < static_cast<int64_t>(buckets.size()))
      start(buckets[next_launch++], /*abandoning=*/true);
  } catch (const std::exception& e) {
    TORCH_WARN("GradientReducer: could not start the remaining buckets of a failed backward: ", e.what());
  }
  // Waited for, not dropped: their transfers must not outlive the process group.
  for (auto& bucket : buckets) {
    try {
      bucket.reduce.wait();
    } catch (const std::exception& e) {
      TORCH_WARN("GradientReducer: a bucket of a failed backward did not complete: ", e.what());
    }
  }
  try {
    rebuild_buckets();  // as the peers whose pass succeeded do
  } catch (const std::exception& e) {
    TORCH_WARN("GradientReducer: could not rebuild the buckets after a failed backward: ", e.what());
  }
  reset();
}

void GradientReducer::Impl::copy_back(Bucket& bucket) {
  bucket.reduce.wait();
  const auto& span = bucket.span;
  const auto flags =
      bucket.buffer.narrow(0, span.numel, static_cast<int64_t>(span.params.size())).to(at::kFloat);
  const float* had = flags.data_ptr<float>();
  at::NoGradGuard no_grad;
  for (size_t j = 0; j < span.params.size(); ++j) {
    if (had[j] == 0) continue;  // no rank had a gradient: .grad stays as it is
    auto& param = params[span.params[j]];
    auto reduced = bucket.buffer.narrow(0, span.offsets[j], span.numels[j]).view(param.sizes());
    auto& grad = param.mutable_grad();
    if (!bucket.grad_views.empty()) {
      grad = bucket.grad_views[j];  // the next backward accumulates into the bucket
    } else if (grad.defined()) {
      grad.copy_(reduced);
    } else {
      grad = reduced.clone();
    }
  }
  bucket.copied_back = true;
  if (bucket.grad_views.empty()) bucket.kept_buffer = std::exchange(bucket.buffer, at::Tensor());
}

void GradientReducer::Impl::finish_backward() {
  struct ResetOnExit {
    Impl* impl;
    ~ResetOnExit() { impl->reset(); }
  } reset_on_exit{this};
  if (!rebuilt) backward_order.end_pass();
  comm::CommRegion region("grad_sync");
  try {
    while (next_launch < static_cast<int64_t>(buckets.size())) launch(buckets[next_launch++]);
    for (auto& bucket : buckets) {
      if (!bucket.copied_back) copy_back(bucket);
    }
  } catch (...) {
    // As a backward that failed: the peers still get every bucket and the rebuild from this rank.
    backward_order.fail_pass();
    abandon();
    throw;
  }
  rebuild_buckets();
}

void GradientReducer::Impl::reset() {
  in_backward = false;
  next_launch = 0;
  std::fill(ready.begin(), ready.end(), false);
  std::fill(unreached.begin(), unreached.end(), false);
  for (auto& bucket : buckets) {
    bucket.waiting = static_cast<int64_t>(bucket.span.params.size());
    bucket.copied_back = false;
    if (!options.gradient_as_bucket_view()) bucket.buffer = at::Tensor();
    bucket.reduce = comm::PendingAllReduce();
  }
}

GradientReducer::GradientReducer(const std::vector<at::Tensor>& params, comm::Group group,
                                 const GradientReducerOptions& options)
    : impl_(std::make_shared<Impl>()) {
  TORCH_CHECK_VALUE(group.is_member(),
                    "GradientReducer: expected a group this rank is a member of, got a non-member");
  auto& impl = *impl_;
  auto initial = detail::agree_on_first_layout(params, options, group);
  impl.params = std::move(initial.params);
  impl.caps = std::move(initial.caps);
  impl.group = std::move(group);
  impl.options = options;
  impl.ready.assign(impl.params.size(), false);
  impl.unreached.assign(impl.params.size(), false);
  impl.install_layout(initial.spans);
  for (size_t i = 0; i < impl.params.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(impl.params[i]);
    impl.hook_keys.push_back(
        accumulator->add_post_hook(std::make_unique<GradientReadyHook>(impl_, static_cast<int64_t>(i))));
    impl.accumulators.push_back(std::move(accumulator));
  }
}

GradientReducer::~GradientReducer() {
  for (size_t i = 0; i < impl_->accumulators.size(); ++i)
    impl_->accumulators[i]->del_post_hook(impl_->hook_keys[i]);
}

void GradientReducer::set_sync(bool sync) { impl_->sync = sync; }
bool GradientReducer::sync() const { return impl_->sync; }

std::vector<std::vector<int64_t>> GradientReducer::bucket_parameters() const {
  std::vector<std::vector<int64_t>> out;
  for (const auto& bucket : impl_->buckets) out.push_back(bucket.span.params);
  return out;
}

const std::vector<at::Tensor>& GradientReducer::parameters() const { return impl_->params; }

}  // namespace hyper_parallel::data_parallel
