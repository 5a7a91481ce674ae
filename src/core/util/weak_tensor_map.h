#pragma once
// Internal: a side table keyed by tensor identity that never keeps a tensor alive, the one such
// table of the library (a parameter's recorded layout, a DTensor's tag, the parameters fully_shard
// manages). Keyed by the TensorImpl's address; each entry holds a weak pointer, which tells a live
// tensor from a dead one (and, while the entry lasts, keeps the dead one's address from being
// reused). Entries of dead tensors are dropped whenever the table has doubled since the last sweep,
// so a long run that makes and drops tensors keeps the table at about twice its live entries, at
// amortized O(1) per insert.
// Thread-safe: every call holds the table's mutex.
//
//   WeakTensorMap<ParameterLayout> layouts;
//   layouts.insert_or_assign(param, layout);
//   if (auto layout = layouts.find(param)) ...

#include <algorithm>
#include <cstddef>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

namespace hyper_parallel::detail {

template <typename Value>
class WeakTensorMap {
 public:
  /// Sets `tensor`'s value, replacing the one it had.
  void insert_or_assign(const at::Tensor& tensor, Value value) {
    std::lock_guard<std::mutex> lock(mutex_);
    sweep_if_grown();
    entries_.insert_or_assign(tensor.unsafeGetTensorImpl(), Entry{weak(tensor), std::move(value)});
  }

  /// Sets `tensor`'s value unless it has one already; whether it was set.
  bool try_insert(const at::Tensor& tensor, Value value) {
    std::lock_guard<std::mutex> lock(mutex_);
    sweep_if_grown();
    auto it = entries_.find(tensor.unsafeGetTensorImpl());
    if (it != entries_.end() && alive(*it)) return false;
    entries_.insert_or_assign(tensor.unsafeGetTensorImpl(), Entry{weak(tensor), std::move(value)});
    return true;
  }

  /// `tensor`'s value, if it has one.
  std::optional<Value> find(const at::Tensor& tensor) const {
    if (!tensor.defined()) return std::nullopt;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(tensor.unsafeGetTensorImpl());
    if (it == entries_.end() || !alive(*it)) return std::nullopt;
    return it->second.value;
  }

  /// The value of the first live tensor for which `pred(tensor)` holds, in no particular order.
  /// `pred` runs under the table's lock: it must not call into the same table.
  template <typename Predicate>
  std::optional<Value> find_if(Predicate pred) const {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& item : entries_) {
      const auto& entry = item.second;
      auto target = entry.tensor.lock();
      if (target && pred(at::Tensor(std::move(target)))) return entry.value;
    }
    return std::nullopt;
  }

  /// Entries, live or not yet swept (for tests of the sweep).
  size_t size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return entries_.size();
  }

 private:
  using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  struct Entry {
    Weak tensor;
    Value value;
  };
  using Map = std::unordered_map<const c10::TensorImpl*, Entry>;

  static Weak weak(const at::Tensor& tensor) { return Weak(tensor.getIntrusivePtr()); }
  static bool alive(const typename Map::value_type& item) { return !item.second.tensor.expired(); }

  void sweep_if_grown() {
    if (entries_.size() < 2 * swept_size_) return;
    for (auto it = entries_.begin(); it != entries_.end();) {
      it = it->second.tensor.expired() ? entries_.erase(it) : std::next(it);
    }
    swept_size_ = std::max<size_t>(entries_.size(), kMinSweepSize);
  }

  static constexpr size_t kMinSweepSize = 64;
  mutable std::mutex mutex_;
  Map entries_;
  size_t swept_size_ = kMinSweepSize;
};

}  // namespace hyper_parallel::detail
