#pragma once
// Internal: the last activation an MC2 column layer gathered, so that the next column layer
// reading the very same activation (Llama's w1 and w3 both read the FFN input) reuses the
// gather instead of moving the same bytes again, as async-TP's all-gather with several weights
// does. An entry matches only while the activation's storage is alive, at the same view and
// version (no in-place change since), on the same group and sequence dim, with the same gradient
// edge (the reader's input gradient must flow where the gather's goes: a gather made under
// no_grad, of a detached view, or of another tensor over the same storage serves no reader that
// needs a gradient), and serves each layer once: a layer that asks again (a new forward pass over the same
// input) gathers afresh, so a gather and its autograd node never outlive the pass that made them.

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <hyper_parallel/core/comm/process_group.h>

namespace hyper_parallel::tensor_parallel::detail {

class SharedGather {
 public:
  /// The process's one cache (forward passes run on one thread at a time).
  static SharedGather& get();

  /// The gather of x made by another layer in this pass, or undefined. `layer` identifies the
  /// caller.
  at::Tensor lookup(const at::Tensor& x, int64_t sequence_dim, const comm::Group& group, const void* layer);
  /// Records that `layer` gathered x into `gathered`.
  void remember(const at::Tensor& x, int64_t sequence_dim, const comm::Group& group, at::Tensor gathered,
                const void* layer);

 private:
  std::mutex mutex_;
  c10::weak_intrusive_ptr<c10::StorageImpl> storage_{c10::intrusive_ptr<c10::StorageImpl>()};
  int64_t offset_ = 0, version_ = -1, sequence_dim_ = -1;
  std::vector<int64_t> sizes_, strides_;
  comm::Group group_;
  at::Tensor gathered_;
  // Where x's gradient goes (its gradient edge), when the gather took one; null otherwise.
  std::weak_ptr<torch::autograd::Node> grad_node_;
  uint32_t grad_input_nr_ = 0;
  bool took_grad_ = false;
  std::vector<const void*> served_;  // the layer that gathered, then those that reused it
};

}  // namespace hyper_parallel::tensor_parallel::detail
