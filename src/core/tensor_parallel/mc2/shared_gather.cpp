#include "shared_gather.h"

#include <algorithm>

#include <c10/core/StorageImpl.h>

namespace hyper_parallel::tensor_parallel::detail {

SharedGather& SharedGather::get() {
  static SharedGather cache;
  return cache;
}

at::Tensor SharedGather::lookup(const at::Tensor& x, int64_t sequence_dim, const comm::Group& group,
                                const void* layer) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto storage = storage_.lock();
  const bool same = storage && storage.get() == x.storage().unsafeGetStorageImpl() &&
                    offset_ == x.storage_offset() && sizes_ == x.sizes().vec() &&
                    strides_ == x.strides().vec() && version_ == x._version() &&
                    sequence_dim_ == sequence_dim && group_.is_member() && &group_.impl() == &group.impl();
  const bool served = std::find(served_.begin(), served_.end(), layer) != served_.end();
  if (!same || served) return at::Tensor();
  served_.push_back(layer);
  return gathered_;
}

void SharedGather::remember(const at::Tensor& x, int64_t sequence_dim, const comm::Group& group,
                            at::Tensor gathered, const void* layer) {
  std::lock_guard<std::mutex> lock(mutex_);
  served_.assign(1, layer);
  storage_ = x.storage().getWeakStorageImpl();
  offset_ = x.storage_offset();
  sizes_ = x.sizes().vec();
  strides_ = x.strides().vec();
  version_ = x._version();
  sequence_dim_ = sequence_dim;
  group_ = group;  // a copy: no later group takes its address while it is remembered
  gathered_ = std::move(gathered);
}

}  // namespace hyper_parallel::tensor_parallel::detail
