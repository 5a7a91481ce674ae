#include <hyper_parallel/core/autograd/gradient_layout.h>

#include <algorithm>
#include <numeric>

#include <ATen/ATen.h>

namespace hyper_parallel::autograd {
namespace {

// Whether `strides` lay `sizes` out in memory with neither gaps nor overlaps (some permutation
// of a contiguous layout; size-1 dims may have any stride).
bool non_overlapping_and_dense(c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  std::vector<size_t> order(sizes.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return strides[a] < strides[b]; });
  int64_t expected = 1;
  for (size_t d : order) {
    if (sizes[d] == 1) continue;
    if (sizes[d] == 0) return true;
    if (strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

bool same_strides(const at::Tensor& t, const GradientLayout& layout) {
  // Strides of size-1 dims never change which element sits where.
  for (size_t d = 0; d < layout.sizes.size(); ++d) {
    if (layout.sizes[d] != 1 && t.stride(static_cast<int64_t>(d)) != layout.strides[d]) return false;
  }
  return true;
}

}  // namespace

GradientLayout GradientLayout::of(const at::Tensor& t) { return of(t.sizes(), t.strides()); }

GradientLayout GradientLayout::of(c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  TORCH_CHECK_VALUE(sizes.size() == strides.size(), "GradientLayout::of: expected one stride per dim (",
                    sizes.size(), "), got ", strides.size());
  return {sizes.vec(), strides.vec(), non_overlapping_and_dense(sizes, strides)};
}

at::Tensor in_layout(const at::Tensor& grad, const GradientLayout& layout) {
  if (!grad.defined() || grad.sizes() != c10::IntArrayRef(layout.sizes)) return grad;
  if (!layout.dense) return grad.contiguous();
  if (same_strides(grad, layout)) return grad;
  return at::empty_strided(layout.sizes, layout.strides, grad.options()).copy_(grad);
}

}  // namespace hyper_parallel::autograd
