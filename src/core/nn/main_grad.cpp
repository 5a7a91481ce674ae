#include <hyper_parallel/core/nn/main_grad.h>

#include <mutex>
#include <utility>

#include <c10/util/Exception.h>

#include "../util/weak_tensor_map.h"

namespace hyper_parallel::nn {
namespace {

detail::WeakTensorMap<at::Tensor>& side_table() {
  static detail::WeakTensorMap<at::Tensor> table;
  return table;
}

MainGradStore default_store() {
  return {[](const at::Tensor& param) { return side_table().find(param).value_or(at::Tensor()); },
          [](const at::Tensor& param, at::Tensor grad) {
            side_table().insert_or_assign(param, std::move(grad));
          }};
}

MainGradStore& store() {
  static MainGradStore current = default_store();
  return current;
}

}  // namespace

at::Tensor main_grad(const at::Tensor& param) { return store().get(param); }

void set_main_grad(const at::Tensor& param, at::Tensor grad) { store().set(param, std::move(grad)); }

void set_main_grad_store(MainGradStore replacement) {
  TORCH_CHECK_VALUE(replacement.get && replacement.set,
                    "set_main_grad_store: expected both get and set, got ", replacement.get ? "" : "no get ",
                    replacement.set ? "" : "no set");
  store() = std::move(replacement);
}

}  // namespace hyper_parallel::nn
