#pragma once
// The layout contract of every backward this library writes: a gradient handed back to autograd
// has the memory layout of the forward input it belongs to (contiguous where the input was),
// as PyTorch's own ops keep it. Some torch 1.13 CPU kernels misread other strides without an
// error: GELU's backward, given a transposed incoming gradient, returns garbage
// (docs/known-torch-bugs.md). A library gradient in its input's layout never hands them one.

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace hyper_parallel::autograd {

/// The sizes and strides of a forward input, kept (without the tensor) for its gradient.
///
/// Usage:
///   const auto layout = GradientLayout::of(x);      // in forward
///   return in_layout(dx, layout);                    // in backward
struct GradientLayout {
  std::vector<int64_t> sizes, strides;
  /// Whether the strides tile memory without gaps or overlaps (then a gradient copies them;
  /// otherwise, e.g. an expanded or sliced input, the gradient is contiguous).
  bool dense = true;

  static GradientLayout of(const at::Tensor& t);
  static GradientLayout of(c10::IntArrayRef sizes, c10::IntArrayRef strides);
};

/// `grad` in `layout`: itself when its strides already match (or its sizes differ from the
/// layout's: not a gradient of that input), else one copy into the layout's strides (or into
/// contiguous memory when the input was not dense). Undefined stays undefined.
at::Tensor in_layout(const at::Tensor& grad, const GradientLayout& layout);

}  // namespace hyper_parallel::autograd
