#pragma once
// How a parameter is laid out over a device mesh once a parallel style has sharded it, and the
// registry that remembers it per tensor. Parameters stay plain local tensors (the optimizer sees
// only its shard and stays fast); whoever needs the global view (checkpoints, clipping, printing,
// the Python front end's layout_of) asks here.

#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/dtensor/device_mesh.h>
#include <hyper_parallel/core/dtensor/placement.h>

namespace hyper_parallel::nn {

struct ParameterLayout {
  dtensor::DeviceMesh mesh;
  dtensor::Placements placements;
  std::vector<int64_t> global_shape;
};

/// Remembers `param`'s layout (replacing an earlier one). Keyed by the tensor itself: the
/// Parameter object, which set_data keeps; forgotten once the tensor is gone.
void record_layout(const at::Tensor& param, ParameterLayout layout);
/// The layout recorded for `param` or for a tensor it aliases exactly (same storage, offset, sizes
/// and strides: param.detach(), param.data), or nullopt (a parameter no style sharded: the same
/// full tensor on every rank).
std::optional<ParameterLayout> recorded_layout(const at::Tensor& param);

}  // namespace hyper_parallel::nn
