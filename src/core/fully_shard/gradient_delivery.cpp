// Where a fully_shard group's reduced gradients go: each shard's .grad, or (MixedPrecisionPolicy
// apply_grad_on_fp32_main_grad) its main gradient in the reduce dtype (nn/main_grad.h), once the
// reduction carrying it is waited for (nn/pending_gradient.h).

#include <string>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <hyper_parallel/core/nn/main_grad.h>
#include <hyper_parallel/core/nn/pending_gradient.h>

#include "param_group_impl.h"
#include "reduce_in_flight.h"

namespace hyper_parallel::fully_shard {
namespace {
// A contribution of a synced backward to a main gradient (none: no rank had one, left as it is).
void add_to_main_grad(const at::Tensor& param, const std::string& name, const at::Tensor& grad) {
  if (!grad.defined() || !param.defined()) return;
  auto held = nn::main_grad(param);
  if (!held.defined()) return nn::set_main_grad(param, grad);
  TORCH_CHECK_VALUE(held.sizes() == grad.sizes(), "fully_shard: expected the main_grad of ", name,
                    " of this rank's shard shape ", grad.sizes(), ", got ", held.sizes());
  at::NoGradGuard no_grad;
  held.add_(grad);  // in place, in its dtype: whoever holds it (an optimizer, a flat buffer) sees it
}

}  // namespace

void ParamGroup::Impl::check_no_hooks_for_main_grad() const {
  if (!to_main_grad) return;
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK_NOT_IMPLEMENTED(
        wants(i) != 2, "fully_shard: expected no gradient hooks on ", names[i],
        " with MixedPrecisionPolicy apply_grad_on_fp32_main_grad (its reduced gradient "
        "goes to main_grad, not through autograd), got a parameter with hooks");
  }
}

void ParamGroup::Impl::defer_to_grad(const std::shared_ptr<detail::ReduceInFlight>& reduced, size_t i,
                                     int64_t offset, size_t slot, bool run_hooks) {
  std::weak_ptr<Impl> weak = shared_from_this();
  auto dropped = [weak, reduced, i] {
    if (auto self = weak.lock()) self->put_back(*reduced, i);
  };
  if (reduced->held) {
    // Held for the all-reduce, at the end of the backward: .grad stays as it is until then.
    const auto padded = layout.padded_elements(static_cast<int64_t>(i));
    nn::defer_completion(
        params[i], [reduced, offset, padded] { return reduced->wait().narrow(0, offset, padded); },
        [weak, reduced, i, slot](const at::Tensor& block) {
          if (auto self = weak.lock())
            self->hold_partial(i, block, reduced->flags == 0 || reduced->reached_anywhere[slot]);
        },
        dropped);
    return;
  }
  const auto elements = layout.local_elements(static_cast<int64_t>(i));
  if (to_main_grad) {
    nn::defer_completion(
        params[i],
        [reduced, param = params[i], offset, elements, slot] {
          return shard_gradient(reduced, param, offset, elements, slot, /*keep_reduce_dtype=*/true);
        },
        [param = params[i], name = names[i]](const at::Tensor& grad) { add_to_main_grad(param, name, grad); },
        dropped);
    return;
  }
  nn::defer_gradient(
      params[i],
      [reduced, param = params[i], offset, elements, slot] {
        return shard_gradient(reduced, param, offset, elements, slot);
      },
      run_hooks, dropped);
}

at::Tensor ParamGroup::Impl::shard_gradient(const std::shared_ptr<detail::ReduceInFlight>& reduce,
                                            const at::Tensor& param, int64_t offset, int64_t elements,
                                            size_t slot, bool keep_reduce_dtype) {
  const auto& reduced = reduce->wait();
  // No rank had a gradient for it (a layer every rank skipped): none, as in one process.
  if (reduce->flags > 0 && !reduce->reached_anywhere[slot]) return {};
  const auto dtype = keep_reduce_dtype ? reduced.scalar_type() : param.scalar_type();
  return reduced.narrow(0, offset, elements).view(param.sizes()).to(dtype).clone();
}

}  // namespace hyper_parallel::fully_shard
