#include "attach_backward.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <hyper_parallel/core/autograd/gradient_layout.h>

namespace hyper_parallel::detail {
namespace {

class FunctionalBackward final : public torch::autograd::Node {
 public:
  struct OutputMeta {
    std::vector<int64_t> sizes;
    at::TensorOptions options;
  };
  FunctionalBackward(uint64_t sequence_nr, BackwardFn fn, std::string name, std::vector<OutputMeta> outputs,
                     std::vector<autograd::GradientLayout> input_layouts, bool materialize)
      : Node(sequence_nr),
        fn_(std::move(fn)),
        name_(std::move(name)),
        outputs_(std::move(outputs)),
        input_layouts_(std::move(input_layouts)),
        materialize_(materialize) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    TORCH_CHECK(fn_ != nullptr, name_,
                ": expected a graph not yet freed, got one released by an "
                "earlier backward (call backward(retain_graph=true) to backward twice)");
    for (size_t i = 0; materialize_ && i < grads.size(); ++i) {
      if (!grads[i].defined()) grads[i] = at::zeros(outputs_[i].sizes, outputs_[i].options);
    }
    // Kept to check, under create_graph, that each gradient it returns is one of these or a view.
    const bool create_graph = torch::autograd::GradMode::is_enabled();
    const auto incoming = create_graph ? grads : torch::autograd::variable_list{};
    auto input_grads = fn_(std::move(grads));
    // The layout contract (autograd/gradient_layout.h): each gradient in its input's layout.
    for (size_t i = 0; i < input_grads.size() && i < input_layouts_.size(); ++i) {
      input_grads[i] = autograd::in_layout(input_grads[i], input_layouts_[i]);
    }
    if (create_graph) check_second_order(incoming, input_grads);
    return input_grads;
  }
  std::string name() const override { return name_; }
  void release_variables() override { fn_ = nullptr; }
  bool released() const { return fn_ == nullptr; }
  std::shared_ptr<void> annotation;  // annotate_node's
  bool identity = false;             // mark_identity's
  bool first_order_only = false;     // mark_first_order_only's

  // create_graph=True runs backward functions with grad mode on, to differentiate the gradients
  // again. A backward computed outside autograd breaks that chain: a gradient that came with a
  // graph leaves as a new tensor without it (communication), or the values read the forward's (a
  // saved softmax). A second derivative through it (a gradient penalty, a Hessian-vector product)
  // would be wrong. Handing a gradient on (itself, or a view of it) keeps the chain.
  void check_second_order(const std::vector<at::Tensor>& incoming,
                          const std::vector<at::Tensor>& returned) const {
    const bool differentiated = std::any_of(incoming.begin(), incoming.end(), [](const at::Tensor& g) {
      return g.defined() && g.requires_grad();
    });
    const auto handed_on = [&](const at::Tensor& g) {
      return !g.defined() || std::any_of(incoming.begin(), incoming.end(), [&](const at::Tensor& in) {
        return in.defined() && g.is_alias_of(in);
      });
    };
    const bool broken =
        first_order_only || (differentiated && !std::all_of(returned.begin(), returned.end(), handed_on));
    TORCH_CHECK_NOT_IMPLEMENTED(
        !broken, name_,
        ": expected a backward without create_graph, got create_graph=True: this op's "
        "backward is computed outside autograd, so a derivative of its gradient (a "
        "gradient penalty, a Hessian-vector product) would be wrong");
  }

 private:
  BackwardFn fn_;
  std::string name_;
  std::vector<OutputMeta> outputs_;  // to make zeros for outputs that got no gradient
  std::vector<autograd::GradientLayout> input_layouts_;
  bool materialize_;
};

}  // namespace

std::vector<at::Tensor> attach_backward(const std::vector<at::Tensor>& inputs,
                                        std::vector<at::Tensor> outputs, BackwardFn backward,
                                        std::string name, bool materialize_grads,
                                        std::optional<uint64_t> sequence_nr) {
  bool any = false;
  for (const auto& t : inputs) any = any || (t.defined() && t.requires_grad());
  if (!any || !torch::autograd::GradMode::is_enabled()) return outputs;
  std::vector<FunctionalBackward::OutputMeta> metas;
  metas.reserve(outputs.size());
  for (auto& out : outputs) metas.push_back({out.sizes().vec(), out.options()});
  std::vector<autograd::GradientLayout> layouts;
  layouts.reserve(inputs.size());
  for (const auto& t : inputs)
    layouts.push_back(t.defined() ? autograd::GradientLayout::of(t) : autograd::GradientLayout{});
  std::shared_ptr<FunctionalBackward> node(
      new FunctionalBackward(sequence_nr ? *sequence_nr : at::sequence_number::get_and_increment(),
                             std::move(backward), std::move(name), std::move(metas), std::move(layouts),
                             materialize_grads),
      torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  for (auto& out : outputs) {
    // A detached result never aliases the inputs' autograd history.
    out = out.detach();
    torch::autograd::set_history(out, node);
  }
  return outputs;
}

bool backward_released(const torch::autograd::Node& node) {
  const auto* functional = dynamic_cast<const FunctionalBackward*>(&node);
  return functional != nullptr && functional->released();
}

bool made_by_attach_backward(const torch::autograd::Node& node) {
  return dynamic_cast<const FunctionalBackward*>(&node) != nullptr;
}

bool annotate_node(torch::autograd::Node& node, std::shared_ptr<void> value) {
  auto* functional = dynamic_cast<FunctionalBackward*>(&node);
  if (functional == nullptr) return false;
  functional->annotation = std::move(value);
  return true;
}

bool mark_identity(torch::autograd::Node& node) {
  auto* functional = dynamic_cast<FunctionalBackward*>(&node);
  if (functional == nullptr) return false;
  functional->identity = true;
  return true;
}

bool mark_first_order_only(torch::autograd::Node& node) {
  auto* functional = dynamic_cast<FunctionalBackward*>(&node);
  if (functional == nullptr) return false;
  functional->first_order_only = true;
  return true;
}

bool is_identity(const torch::autograd::Node& node) {
  const auto* functional = dynamic_cast<const FunctionalBackward*>(&node);
  return functional != nullptr && functional->identity;
}

std::shared_ptr<void> node_annotation(const torch::autograd::Node& node) {
  const auto* functional = dynamic_cast<const FunctionalBackward*>(&node);
  return functional != nullptr ? functional->annotation : nullptr;
}

at::Tensor attach_backward(const at::Tensor& input, at::Tensor output,
                           std::function<at::Tensor(const at::Tensor&)> backward, std::string name) {
  return attach_backward(
      std::vector<at::Tensor>{input}, std::vector<at::Tensor>{std::move(output)},
      [fn = std::move(backward)](std::vector<at::Tensor> grads) {
        return std::vector<at::Tensor>{fn(grads[0])};
      },
      std::move(name))[0];
}

}  // namespace hyper_parallel::detail
