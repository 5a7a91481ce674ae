#pragma once
// Work: a handle to an asynchronous transfer. wait() blocks until it completes and throws a
// c10::Error if the transfer failed (peer gone, timeout).

#include <memory>

namespace hyper_parallel::comm {

namespace detail {
struct WorkImpl {
  virtual ~WorkImpl() = default;
  virtual void wait() = 0;
  virtual bool is_completed() = 0;
};
}  // namespace detail

class Work {
 public:
  Work() = default;  // an already-completed no-op (e.g. a zero-byte transfer)
  explicit Work(std::shared_ptr<detail::WorkImpl> impl) : impl_(std::move(impl)) {}

  /// Blocks until done; throws on failure. Calling it again is a no-op.
  void wait() {
    if (impl_) {
      impl_->wait();
      impl_.reset();
    }
  }
  bool is_completed() const { return !impl_ || impl_->is_completed(); }

 private:
  std::shared_ptr<detail::WorkImpl> impl_;
};

}  // namespace hyper_parallel::comm
