#pragma once
// Internal: give tensors computed outside autograd a hand-written backward. This library's
// differentiable communication (DTensor conversions, MC2 fused ops) needs backward state that is
// not a tensor (mesh, placements, groups), which torch::autograd::Function cannot carry.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::autograd {
struct Node;
}  // namespace torch::autograd

namespace hyper_parallel::detail {

/// Gradients of the outputs (undefined ones replaced by zeros unless materialize_grads is false)
/// -> gradients of the inputs (undefined where an input needs none).
using BackwardFn = std::function<std::vector<at::Tensor>(std::vector<at::Tensor> grad_outputs)>;

/// Makes `outputs` (computed from `inputs` under no-grad; must not alias them) differentiable
/// with `backward`. Returns them unchanged when no input requires grad or grad mode is off.
/// `sequence_nr` sets the node's place in the engine's queue (among ready nodes, the highest
/// runs first); by default it is the next one, as for any op recorded now.
std::vector<at::Tensor> attach_backward(const std::vector<at::Tensor>& inputs,
                                        std::vector<at::Tensor> outputs, BackwardFn backward,
                                        std::string name, bool materialize_grads = true,
                                        std::optional<uint64_t> sequence_nr = std::nullopt);

/// Whether `node` is one made by attach_backward whose backward has run and released its state
/// (a graph kept alive after its backward without retain_graph).
bool backward_released(const torch::autograd::Node& node);

/// Whether `node` was made by attach_backward.
bool made_by_attach_backward(const torch::autograd::Node& node);
/// Lets a node made by attach_backward carry `value` for whoever walks the graph later (a
/// DTensor's tag, for the tensors computed from the tagged one). False if `node` is not one.
bool annotate_node(torch::autograd::Node& node, std::shared_ptr<void> value);
/// Marks a node made by attach_backward whose outputs are its inputs' values, unchanged (a hook
/// point such as fully_shard's pre-backward node): a walk of the graph for a layout passes through
/// it. False if `node` is not one.
bool mark_identity(torch::autograd::Node& node);
/// Marks a node made by attach_backward whose gradient depends on the forward's values (a saved
/// softmax): under create_graph its backward raises, even for gradients without a graph. The
/// others raise only where gradients came with a graph and one leaves as a new tensor, neither
/// one of them nor a view (computed by communication). False if `node` is not one.
bool mark_first_order_only(torch::autograd::Node& node);
/// Whether mark_identity marked `node`.
bool is_identity(const torch::autograd::Node& node);
/// The value annotate_node gave `node`, else null.
std::shared_ptr<void> node_annotation(const torch::autograd::Node& node);

/// Single-input, single-output convenience.
at::Tensor attach_backward(const at::Tensor& input, at::Tensor output,
                           std::function<at::Tensor(const at::Tensor&)> backward, std::string name);

}  // namespace hyper_parallel::detail
