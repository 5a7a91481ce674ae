#pragma once
// How a parallel style lays out a module's parameters (its parameter table), and the in-place
// operations that do it. The styles of this library apply them to hyper_parallel::nn modules;
// the Python front end applies the same tables and operations to torch.nn modules.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/dtensor/device_mesh.h>
#include <hyper_parallel/core/dtensor/placement.h>

namespace hyper_parallel::tensor_parallel {

/// One row of a style's parameter table.
struct ParameterSharding {
  /// The parameter's name in its module ("weight", "bias").
  std::string name;
  /// Its placements on the 1-d TP mesh.
  dtensor::Placements placements;
  /// Replicated, but the gradient of each rank's forward covers its own tokens only (Partial):
  /// the module reads it through sum_gradient_on_read, so that gradient is summed over the mesh.
  bool sums_gradient = false;
};

/// Replaces `param`'s data by its local shard under `placements`, in place (the parameter object,
/// and an optimizer's reference to it, stay valid): cut from the values of TP rank
/// `src_data_rank`, so all ranks hold shards of one tensor even if their initialisation differed,
/// or from each rank's own copy if nullopt. Collective over the mesh unless nullopt. The layout
/// is recorded (nn::record_layout), so checkpoints, clipping and full_tensor see it.
void shard_parameter_in_place(const at::Tensor& param, const dtensor::DeviceMesh& mesh,
                              const dtensor::Placements& placements, std::optional<int64_t> src_data_rank);

/// `read` (what a module computes with for a replicated parameter: the parameter itself, or
/// fully_shard's gathered copy of it) as a tensor whose gradient is summed over the 1-d mesh in
/// backward (an all_reduce, counted in CommRegion "grad_sync"): the Partial gradient of a forward
/// that saw only this rank's tokens becomes the Replicate one. Other gradients of the parameter
/// (a loss term on the parameter itself, which every rank computes alike) reach .grad as they
/// are, as PyTorch keeps a Replicate gradient apart from a Partial one. Every rank of the mesh
/// reads in the same order and runs the same backward, so the sums start in the same order.
///
/// When `read` is the parameter itself (a leaf) and nothing watches its gradient (no gradient
/// hook, no capture by autograd.grad), the sum is started and the backward goes on while it
/// travels: it is added to .grad by the end of the backward, or before, when a reader such as
/// data_parallel's reducer asks (nn/pending_gradient.h; torch's DistributedDataParallel does not
/// ask: use data_parallel with these styles). Otherwise the backward waits for the sum, so hooks,
/// captures and a gathered copy's own backward see the whole gradient. Returns `read` itself on a
/// 1-rank mesh, without grad mode, or when it needs no gradient.
at::Tensor sum_gradient_on_read(const at::Tensor& read, const dtensor::DeviceMesh& mesh);

}  // namespace hyper_parallel::tensor_parallel
