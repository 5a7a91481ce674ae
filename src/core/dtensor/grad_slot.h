#pragma once
// Internal (dtensor.cpp): where the gradients a DTensor's consumers declared in other placements
// wait for its producer's backward, and the producers' backward that collects them.

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>

#include <hyper_parallel/core/dtensor/dtensor.h>

#include "../autograd/attach_backward.h"

namespace hyper_parallel::dtensor {

// What a DTensor's producer (from_local, redistribute, distribute_tensor) needs in backward
// beside the gradient autograd sums into its local tensor: the gradients its consumers declared
// in other placements (to_local(grad_placements): a column-parallel matmul's Partial input
// gradient). They cannot join autograd's sum, which holds one placement, so they wait here, one
// sum per placements, and the producer's backward converts each once: a Partial sum then
// reduce-scatters once, however many column layers read the DTensor.
struct DTensor::GradSlot {
  using Convert = std::function<at::Tensor(const at::Tensor& grad, const Placements& from)>;
  std::vector<std::pair<Placements, at::Tensor>> declared;
  std::weak_ptr<torch::autograd::Node> producer;  // the node whose backward converges them

  void add(const Placements& placements, const at::Tensor& grad) {
    for (auto& [pl, sum] : declared) {
      if (pl == placements) {
        sum = sum + grad;
        return;
      }
    }
    declared.emplace_back(placements, grad);
  }

  /// `grad` (in the DTensor's own gradient placements `own`; undefined if no consumer sent one
  /// that way) plus every declared gradient, each converted by `convert`. Undefined if none came.
  at::Tensor converge(const at::Tensor& grad, const Placements& own, const Convert& convert) {
    at::Tensor total = grad.defined() ? convert(grad, own) : at::Tensor();
    auto taken = std::move(declared);
    declared.clear();
    for (auto& [pl, sum] : taken) {
      auto part = convert(sum, pl);
      total = total.defined() ? total + part : part;
    }
    return total;
  }
};

// The node DTensor::from_local puts on its local tensor. A gradient that reaches it through
// autograd is in the DTensor's own placements, which it keeps: for such a gradient it is an
// identity onto the wrapped tensor's gradient edge (its one next edge).
inline constexpr char kFromLocalBackward[] = "DTensorFromLocalBackward";

// attach_backward for a producer: the gradients of its DTensor's local tensor converge in `slot`.
inline at::Tensor attach_producer_backward(const at::Tensor& input, const at::Tensor& output,
                                           const std::shared_ptr<DTensor::GradSlot>& slot, Placements own,
                                           DTensor::GradSlot::Convert convert, const char* name) {
  auto out = detail::attach_backward(
      {input}, {output},
      [slot, own = std::move(own), convert = std::move(convert)](std::vector<at::Tensor> grads) {
        return std::vector<at::Tensor>{slot->converge(grads[0], own, convert)};
      },
      name, /*materialize_grads=*/false)[0];
  slot->producer = out.grad_fn();
  return out;
}

}  // namespace hyper_parallel::dtensor
