#include <hyper_parallel/core/nn/pending_gradient.h>

#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

namespace hyper_parallel::nn {
namespace {

using WeakParam = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct Entry {
  WeakParam param;  // the parameter (weak: the registry never keeps one alive)
  WaitForGradient wait;
  bool run_hooks = false;                           // the parameter's hooks see the waited tensor first
  std::function<void(const at::Tensor&)> complete;  // takes the waited tensor instead of .grad
  OnDropped dropped;                                // a failed backward drops it
};

void drop(Entry& e) noexcept {
  if (!e.dropped) return;
  try {
    e.dropped();
  } catch (...) {  // the failure that stopped the backward is already on its way to the caller
  }
}

struct Registry {
  std::mutex mutex;
  std::vector<Entry> entries;  // in flight, in the order they started
  bool pass_open = false;      // an end-of-backward finish is queued
};

Registry& registry() {
  static Registry r;
  return r;
}

std::optional<Entry> take(const c10::TensorImpl* param) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto it = r.entries.begin(); it != r.entries.end(); ++it) {
    if (param == nullptr || it->param._unsafe_get_target() == param) {
      Entry e = std::move(*it);
      r.entries.erase(it);
      return e;
    }
  }
  return std::nullopt;
}

// .grad += the sum: the bits AccumulateGrad would have left had it added the sum.
void apply(Entry& e) {
  at::Tensor sum;
  try {
    sum = e.wait();
  } catch (...) {
    drop(e);
    throw;
  }
  if (e.complete) {
    e.complete(sum);
    return;
  }
  auto impl = e.param.lock();
  if (!impl || !sum.defined()) return;  // undefined: no contribution (no hook sees it)
  at::Tensor param(std::move(impl));
  if (e.run_hooks) {
    try {
      sum = torch::autograd::AccumulateGrad::callHooks(param, std::move(sum));
    } catch (...) {
      drop(e);
      throw;
    }
  }
  at::NoGradGuard no_grad;
  auto& grad = param.mutable_grad();
  if (grad.defined() && grad.sizes() == sum.sizes()) {
    grad.add_(sum);  // in place, as AccumulateGrad adds: no temporary of the gradient's size
  } else {
    grad = grad.defined() ? grad.add(sum) : sum;
  }
}

// The backward failed before its final callback (or a sum failed in it): wait for the
// transfers (so none outlives its buffers or leaves a peer waiting) and drop their results:
// .grad keeps what it holds, as torch leaves it. Only a failed mutex could throw here, and then
// terminating is all that is left.
void abandon_all() noexcept {  // NOLINT(bugprone-exception-escape)
  while (auto e = take(nullptr)) {
    try {
      e->wait();
    } catch (...) {  // the failure that stopped the backward is already on its way to the caller
    }
    drop(*e);
  }
  std::lock_guard<std::mutex> lock(registry().mutex);
  registry().pass_open = false;
}

void open_pass() {
  struct PassGuard {
    bool ran = false;
    ~PassGuard() {  // NOLINT(bugprone-exception-escape): abandon_all is noexcept
      if (!ran) abandon_all();
    }
  };
  auto guard = std::make_shared<PassGuard>();
  torch::autograd::Engine::get_default_engine().queue_callback([guard] {
    guard->ran = true;
    {
      std::lock_guard<std::mutex> lock(registry().mutex);
      registry().pass_open = false;
    }
    try {
      finish_all_gradients();
    } catch (...) {
      abandon_all();  // no sum of this pass is left for the next one to apply
      throw;
    }
  });
}

void defer(Entry e) {
  bool open = false;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.entries.push_back(std::move(e));
    open = !r.pass_open;
    r.pass_open = true;
  }
  if (open) open_pass();
}

}  // namespace

void defer_gradient(const at::Tensor& param, WaitForGradient wait, bool run_hooks, OnDropped dropped) {
  TORCH_INTERNAL_ASSERT(param.defined() && wait, "defer_gradient: undefined argument");
  defer(Entry{WeakParam(param.getIntrusivePtr()), std::move(wait), run_hooks, {}, std::move(dropped)});
}

void defer_completion(const at::Tensor& param, WaitForGradient wait,
                      std::function<void(const at::Tensor&)> complete, OnDropped dropped) {
  TORCH_INTERNAL_ASSERT(param.defined() && wait && complete, "defer_completion: undefined argument");
  defer(Entry{WeakParam(param.getIntrusivePtr()), std::move(wait), false, std::move(complete),
              std::move(dropped)});
}

void finish_gradient(const at::Tensor& param) {
  while (auto e = take(param.unsafeGetTensorImpl())) apply(*e);
}

void finish_all_gradients() {
  while (auto e = take(nullptr)) apply(*e);
}

}  // namespace hyper_parallel::nn
