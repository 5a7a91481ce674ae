#pragma once
// Internal: a tensor a hand-written backward reads (a Linear's input or weight), kept with the
// version it had when saved. Reading it after an in-place change is an error naming the op, as
// torch's own SavedVariable makes it, never a gradient silently computed from the new values.

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

namespace hyper_parallel::detail {

class SavedTensor {
 public:
  SavedTensor() = default;
  /// Keeps `t` (detached: no autograd history, the same storage and version counter). `op` and
  /// `what` name it in the error, e.g. ("MC2RowLinearBackward", "input").
  SavedTensor(const at::Tensor& t, std::string op, std::string what);
  /// The tensor; a c10::Error "<op>: expected its <what> saved in forward at version V, got
  /// version W: it was modified by an in-place operation ..." if it changed since.
  const at::Tensor& get() const;

 private:
  at::Tensor tensor_;
  int64_t version_ = 0;
  std::string op_, what_;
};

}  // namespace hyper_parallel::detail
