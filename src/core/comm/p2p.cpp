#include <hyper_parallel/core/comm/p2p.h>

#include <c10/util/Exception.h>

#include "group_impl.h"

namespace hyper_parallel::comm {
namespace {

// Internal tags live above the user range: base | op block | step.
constexpr int64_t kInternalTagBase = int64_t{1} << 30;
constexpr int64_t kOpBlocks = int64_t{1} << 19;  // blocks wrap; 2^19 ops apart never overlap

class C10dWork final : public detail::WorkImpl {
 public:
  C10dWork(c10::intrusive_ptr<c10d::Work> work, std::string what)
      : work_(std::move(work)), what_(std::move(what)) {}
  void wait() override {
    try {
      work_->wait();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "hyper_parallel::comm: ", what_, " failed: ", e.what());
    }
  }
  bool is_completed() override { return work_->isCompleted(); }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::string what_;
};

// Gloo 1.13 rejects bf16 in some paths; transfers only move bytes, so send 2-byte floats as int16.
at::Tensor as_wire_tensor(const at::Tensor& t) {
  if (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf) return t.view(at::kShort);
  return t;
}

void check_transfer(const char* fn, const at::Tensor& t, int64_t peer, const Group& group) {
  TORCH_CHECK(t.defined(), "hyper_parallel::comm::", fn, ": expected a defined tensor, got undefined");
  TORCH_CHECK(t.is_contiguous(), "hyper_parallel::comm::", fn,
              ": expected a contiguous tensor, got strides ", t.strides());
  TORCH_CHECK(peer >= 0 && peer < group.size(), "hyper_parallel::comm::", fn,
              ": expected peer rank in [0, ", group.size(), ") of ", group.name(), ", got ", peer);
  TORCH_CHECK(peer != group.rank(), "hyper_parallel::comm::", fn,
              ": expected a peer other than this rank (", peer, ")");
}

}  // namespace

int OpTags::step(int64_t step) const {
  TORCH_INTERNAL_ASSERT(step >= 0 && step < kMaxSteps, "OpTags::step: step ", step,
                        " out of range");
  return static_cast<int>(base_ + step);
}

OpTags reserve_tags(const Group& group) {
  int64_t op = group.impl().next_op.fetch_add(1) % kOpBlocks;
  static_assert(kInternalTagBase + kOpBlocks * OpTags::kMaxSteps < (int64_t{1} << 31));
  return OpTags(kInternalTagBase + op * OpTags::kMaxSteps);
}

Work isend(const at::Tensor& tensor, int64_t dst, const Group& group, int tag) {
  check_transfer("isend", tensor, dst, group);
  if (tensor.numel() == 0) return Work();
  std::vector<at::Tensor> tensors{as_wire_tensor(tensor)};
  auto work = group.impl().backend->send(tensors, static_cast<int>(dst), tag);
  return Work(std::make_shared<C10dWork>(
      std::move(work), "send to rank " + std::to_string(dst) + " of " + group.name()));
}

Work irecv(const at::Tensor& tensor, int64_t src, const Group& group, int tag) {
  check_transfer("irecv", tensor, src, group);
  if (tensor.numel() == 0) return Work();
  std::vector<at::Tensor> tensors{as_wire_tensor(tensor)};
  auto work = group.impl().backend->recv(tensors, static_cast<int>(src), tag);
  return Work(std::make_shared<C10dWork>(
      std::move(work), "receive from rank " + std::to_string(src) + " of " + group.name()));
}

}  // namespace hyper_parallel::comm
