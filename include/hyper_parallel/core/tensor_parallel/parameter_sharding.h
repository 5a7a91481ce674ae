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
  /// Replicated, but each rank's gradient covers its own tokens only (Partial): a gradient hook
  /// sums it over the mesh before any optimizer sees it (sum_gradient_over_mesh).
  bool sums_gradient = false;
};

/// Replaces `param`'s data by its local shard under `placements`, in place (the parameter object,
/// and an optimizer's reference to it, stay valid): cut from the values of TP rank
/// `src_data_rank`, so all ranks hold shards of one tensor even if their initialisation differed,
/// or from each rank's own copy if nullopt. Collective over the mesh unless nullopt. The layout
/// is recorded (nn::record_layout), so checkpoints, clipping and full_tensor see it.
void shard_parameter_in_place(const at::Tensor& param, const dtensor::DeviceMesh& mesh,
                              const dtensor::Placements& placements, std::optional<int64_t> src_data_rank);

/// Registers a gradient hook that sums `param`'s gradient over the 1-d mesh (an all_reduce,
/// counted in CommRegion "grad_sync"). The hook starts the sum and returns: the backward goes on
/// while it travels, and the sum replaces this rank's part in .grad by the end of the backward
/// (or before, when a reader such as data_parallel's reducer asks: nn/pending_gradient.h).
/// Hooks registered after it see this rank's part, and what they change is replaced by the sum;
/// a reader of .grad during the backward must call nn::finish_gradient first (data_parallel's
/// reducer does; torch's DistributedDataParallel does not: use data_parallel with these
/// styles). Every rank of the mesh runs the same backward,
/// so the sums start in the same order everywhere. Nothing on a 1-rank mesh or for a parameter
/// that needs no gradient.
void sum_gradient_over_mesh(const at::Tensor& param, const dtensor::DeviceMesh& mesh);

}  // namespace hyper_parallel::tensor_parallel
