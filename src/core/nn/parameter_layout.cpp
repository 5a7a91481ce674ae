#include <hyper_parallel/core/nn/parameter_layout.h>

#include <mutex>
#include <unordered_map>

#include <c10/core/TensorImpl.h>

namespace hyper_parallel::nn {
namespace {

struct Recorded {
  c10::weak_intrusive_ptr<c10::TensorImpl> tensor;
  ParameterLayout layout;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<const c10::TensorImpl*, Recorded> by_tensor;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void record_layout(const at::Tensor& param, ParameterLayout layout) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  // Entries of tensors that are gone would otherwise pile up (and their address be reused).
  for (auto it = r.by_tensor.begin(); it != r.by_tensor.end();) {
    it = it->second.tensor.expired() ? r.by_tensor.erase(it) : std::next(it);
  }
  r.by_tensor.insert_or_assign(
      param.unsafeGetTensorImpl(),
      Recorded{c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()), std::move(layout)});
}

namespace {

// `a` and `b` view the same elements of the same storage (e.g. a parameter and its detach()).
bool same_view(const c10::TensorImpl& a, const at::Tensor& b) {
  return a.has_storage() && b.has_storage() &&
         a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl() &&
         a.storage_offset() == b.storage_offset() && a.sizes() == b.sizes() && a.strides() == b.strides();
}

}  // namespace

std::optional<ParameterLayout> recorded_layout(const at::Tensor& param) {
  if (!param.defined()) return std::nullopt;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.by_tensor.find(param.unsafeGetTensorImpl());
  if (it != r.by_tensor.end() && it->second.tensor.lock().get() == param.unsafeGetTensorImpl()) {
    return it->second.layout;
  }
  // An alias of a recorded parameter (param.detach(), param.data) is laid out as it is.
  for (const auto& [impl, recorded] : r.by_tensor) {
    auto alive = recorded.tensor.lock();
    if (alive && same_view(*alive, param)) return recorded.layout;
  }
  return std::nullopt;
}

}  // namespace hyper_parallel::nn
