#pragma once
// Whole-model helpers that know which parameters are sharded (from the layouts styles record).

#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch::nn {
class Module;
}

namespace hyper_parallel::tensor_parallel {

/// Clips gradients (a parameter's main gradient where it has one, nn/main_grad.h, else its .grad)
/// by their global L2 norm: sharded parameters' squared norms are summed over
/// their mesh, replicated ones counted once. Returns the norm before clipping. All ranks call it.
/// As torch's, the gradients are multiplied by min(1, max_norm / (norm + 1e-6)) (a nan norm
/// makes them nan); max_norm >= 0 (0 zeroes them), else c10::ValueError.
double clip_grad_norm_(torch::nn::Module& module, double max_norm);

/// The same over a list of parameters (a torch.nn module's, from Python), each laid out as its
/// style recorded it (nn::recorded_layout; none: replicated). The norm is the global parameters'
/// norm, as a single process would compute it.
double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm);
/// The global L2 norm clip_grad_norm_ would clip by, without clipping. Collective as it is.
double grad_norm(const std::vector<at::Tensor>& parameters);

/// `param`'s full value: gathered over its recorded layout's mesh (collective over it), or a
/// copy of `param` if it is not sharded.
at::Tensor full_tensor(const at::Tensor& param);
/// The full value of `value`, a tensor laid out as `param` (e.g. its .grad()). Collective.
at::Tensor full_tensor(const at::Tensor& param, const at::Tensor& value);

/// Every parameter (or its gradient) as the full, unsharded tensor, by fully qualified name.
/// Collective for sharded parameters: all ranks call it.
std::vector<std::pair<std::string, at::Tensor>> full_named_parameters(torch::nn::Module& module,
                                                                      bool gradients = false);

}  // namespace hyper_parallel::tensor_parallel
