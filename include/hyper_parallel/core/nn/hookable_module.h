#pragma once
// HookableModule: the hook points of this library's modules. libtorch's C++ modules have no
// forward hooks, so hyper_parallel::nn modules call these in their forward: input hooks, a
// replaceable forward kernel (Linear, Embedding), output hooks. Whoever holds the module (the
// parallel styles of core/tensor_parallel, or a user) fills them from outside, so a model's code
// never changes. This layer knows nothing of styles: it only stores what they install.

#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/dtensor/device_mesh.h>
#include <hyper_parallel/core/dtensor/placement.h>
#include <hyper_parallel/core/nn/parameter_layout.h>

namespace hyper_parallel::nn {

/// What a module computes, so that whoever fills its hooks knows what it may change.
enum class ModuleKind { kLinear, kEmbedding, kOther };

/// Computes a Linear or Embedding forward from the module's (possibly sharded) parameters.
/// Installed when the computation itself changes with the layout, e.g. a row-parallel Linear
/// (local matmul, reduce, then the bias) or a fused collective + matmul.
class ForwardKernel {
 public:
  virtual ~ForwardKernel() = default;
  /// `bias` may be undefined.
  virtual at::Tensor forward(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias) = 0;
  virtual std::string name() const = 0;
};

class HookableModule {
 public:
  /// Receives the module's tensor inputs (in forward order) and returns the ones to use.
  using InputHook = std::function<std::vector<at::Tensor>(std::vector<at::Tensor>)>;
  /// Receives the module's outputs and returns the ones to give the caller.
  using OutputHook = std::function<std::vector<at::Tensor>(std::vector<at::Tensor>)>;

  virtual ~HookableModule() = default;
  virtual ModuleKind module_kind() const { return ModuleKind::kOther; }

  /// Hooks run in the order they were added.
  void add_input_hook(InputHook hook) { input_hooks_.push_back(std::move(hook)); }
  void add_output_hook(OutputHook hook) { output_hooks_.push_back(std::move(hook)); }
  size_t num_input_hooks() const { return input_hooks_.size(); }
  size_t num_output_hooks() const { return output_hooks_.size(); }

  /// Linear / Embedding only: replaces how forward computes from input and parameters.
  void set_forward_kernel(std::shared_ptr<ForwardKernel> kernel) { kernel_ = std::move(kernel); }

  /// The tensor forward uses for a parameter: given its name and the registered tensor, returns
  /// the one to compute with (e.g. fully_shard's gathered parameter for a sharded one). One per
  /// module; empty: the registered tensor itself.
  using ParameterView = std::function<at::Tensor(const std::string& name, const at::Tensor& registered)>;
  void set_parameter_view(ParameterView view) { parameter_view_ = std::move(view); }
  bool has_parameter_view() const { return static_cast<bool>(parameter_view_); }

  /// Changes the tensor forward computes with for a parameter, after the view: given its name, the
  /// registered tensor and what the view (or the registered tensor) gives, returns the one to use
  /// (e.g. a style's node that sums the gradient of this module's reads over its group). Hooks run
  /// in the order they were added.
  using ParameterReadHook = std::function<at::Tensor(const std::string& name, const at::Tensor& registered,
                                                     const at::Tensor& read)>;
  void add_parameter_read_hook(ParameterReadHook hook) { read_hooks_.push_back(std::move(hook)); }
  const std::shared_ptr<ForwardKernel>& forward_kernel() const { return kernel_; }

  /// The layout a style or fully_shard gave this module's parameter `name`: its recorded layout
  /// (nn::recorded_layout, the one record of layouts); none if unsharded or no such parameter.
  std::optional<ParameterLayout> parameter_layout(const std::string& name) const;

  /// Names of what was applied to this module (e.g. parallel styles), in order, for printing.
  void add_applied_style(std::string name) { styles_.push_back(std::move(name)); }
  const std::vector<std::string>& applied_styles() const { return styles_; }

  /// What was done to this module, for pretty_print: ", style=ColwiseParallel,
  /// weight=Shard(0) over tp[2], forward=..." (nothing for an untouched module).
  void print_parallel_state(std::ostream& stream) const;

 protected:
  /// Call at the start of forward with the tensor inputs; use what it returns.
  std::vector<at::Tensor> run_input_hooks(std::vector<at::Tensor> inputs) const {
    for (const auto& hook : input_hooks_) inputs = hook(std::move(inputs));
    return inputs;
  }
  /// Call at the end of forward with the outputs; return what it returns.
  std::vector<at::Tensor> run_output_hooks(std::vector<at::Tensor> outputs) const {
    for (const auto& hook : output_hooks_) outputs = hook(std::move(outputs));
    return outputs;
  }
  at::Tensor run_input_hooks(at::Tensor input) const {
    return input_hooks_.empty() ? input : run_input_hooks(std::vector<at::Tensor>{std::move(input)})[0];
  }
  at::Tensor run_output_hooks(at::Tensor output) const {
    return output_hooks_.empty() ? output : run_output_hooks(std::vector<at::Tensor>{std::move(output)})[0];
  }
  /// Call in forward for each parameter it reads (an undefined one stays undefined).
  at::Tensor parameter(const std::string& name, const at::Tensor& registered) const {
    if (!registered.defined()) return registered;
    auto read = parameter_view_ ? parameter_view_(name, registered) : registered;
    for (const auto& hook : read_hooks_) read = hook(name, registered, read);
    return read;
  }

 private:
  std::vector<InputHook> input_hooks_;
  std::vector<OutputHook> output_hooks_;
  std::shared_ptr<ForwardKernel> kernel_;
  ParameterView parameter_view_;
  std::vector<ParameterReadHook> read_hooks_;
  std::vector<std::string> styles_;
};

}  // namespace hyper_parallel::nn
