#include <hyper_parallel/core/nn/parameter_layout.h>

#include <c10/core/TensorImpl.h>

#include "../util/weak_tensor_map.h"

namespace hyper_parallel::nn {
namespace {

hyper_parallel::detail::WeakTensorMap<ParameterLayout>& layouts() {
  static hyper_parallel::detail::WeakTensorMap<ParameterLayout> table;
  return table;
}

// `a` and `b` view the same elements of the same storage (e.g. a parameter and its detach()).
bool same_view(const at::Tensor& a, const at::Tensor& b) {
  return a.has_storage() && b.has_storage() &&
         a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl() &&
         a.storage_offset() == b.storage_offset() && a.sizes() == b.sizes() && a.strides() == b.strides();
}

}  // namespace

void record_layout(const at::Tensor& param, ParameterLayout layout) {
  layouts().insert_or_assign(param, std::move(layout));
}

std::optional<ParameterLayout> recorded_layout(const at::Tensor& param) {
  if (!param.defined()) return std::nullopt;
  if (auto layout = layouts().find(param)) return layout;
  // An alias of a recorded parameter (param.detach(), param.data) is laid out as it is.
  return layouts().find_if([&](const at::Tensor& recorded) { return same_view(recorded, param); });
}

}  // namespace hyper_parallel::nn
