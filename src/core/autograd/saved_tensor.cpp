#include "saved_tensor.h"

#include <c10/util/Exception.h>

namespace hyper_parallel::detail {

SavedTensor::SavedTensor(const at::Tensor& t, std::string op, std::string what)
    : tensor_(t.defined() ? t.detach() : at::Tensor()),
      version_(t.defined() ? t._version() : 0),
      op_(std::move(op)),
      what_(std::move(what)) {}

const at::Tensor& SavedTensor::get() const {
  TORCH_CHECK(!tensor_.defined() || tensor_._version() == version_, op_, ": expected its ", what_,
              " saved in forward at version ", version_, ", got version ", tensor_._version(),
              ": it was modified by an in-place operation after the forward (clone it before changing "
              "it, as for any op that saves its inputs for the backward)");
  return tensor_;
}

}  // namespace hyper_parallel::detail
