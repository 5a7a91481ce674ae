#include <hyper_parallel/core/dtensor/placement.h>

#include <algorithm>
#include <sstream>

#include <c10/util/Exception.h>

namespace hyper_parallel::dtensor {

int64_t Placement::dim() const {
  TORCH_CHECK(is_shard(), "Placement::dim: expected a Shard placement, got ", str());
  return dim_;
}

comm::ReduceOp Placement::reduce_op() const {
  TORCH_CHECK(is_partial(), "Placement::reduce_op: expected a Partial placement, got ", str());
  return op_;
}

Placement Placement::normalized(int64_t ndim) const {
  if (!is_shard()) return *this;
  TORCH_CHECK(dim_ >= -ndim && dim_ < ndim, "Placement::normalized: expected Shard dim in [", -ndim, ", ",
              ndim, ") for a ", ndim, "-d tensor, got ", str());
  return shard(dim_ < 0 ? dim_ + ndim : dim_);
}

std::string Placement::str() const {
  switch (kind_) {
    case Kind::kShard:
      return "Shard(" + std::to_string(dim_) + ")";
    case Kind::kReplicate:
      return "Replicate()";
    case Kind::kPartial:
      return std::string("Partial(") + comm::to_string(op_) + ")";
  }
  return "?";
}

bool Placement::operator==(const Placement& other) const {
  if (kind_ != other.kind_) return false;
  if (is_shard()) return dim_ == other.dim_;
  if (is_partial()) return op_ == other.op_;
  return true;
}

std::string to_string(const Placements& placements) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < placements.size(); ++i) s << (i ? ", " : "") << placements[i].str();
  s << "]";
  return s.str();
}

Placements placements_from_names(const std::vector<std::vector<std::string>>& tensor_dims,
                                 const std::vector<std::string>& mesh_dim_names, int64_t ndim) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(tensor_dims.size()) == ndim,
                    "placements_from_names: expected one layout name per tensor dim (", ndim, "), got ",
                    tensor_dims.size());
  TORCH_CHECK_VALUE(!mesh_dim_names.empty(),
                    "placements_from_names: expected a mesh with dim names to name its dims, got a mesh "
                    "without names");
  Placements placements(mesh_dim_names.size(), Replicate());
  std::vector<bool> named(mesh_dim_names.size(), false);
  for (size_t d = 0; d < tensor_dims.size(); ++d) {
    int64_t previous = -1;  // the mesh dim of the last name of this tensor dim
    for (const auto& name : tensor_dims[d]) {
      if (name == "None") continue;
      const auto it = std::find(mesh_dim_names.begin(), mesh_dim_names.end(), name);
      TORCH_CHECK_VALUE(it != mesh_dim_names.end(), "placements_from_names: expected names of mesh dims ",
                        c10::ArrayRef<std::string>(mesh_dim_names), " or 'None', got '", name,
                        "' for tensor dim ", d);
      const auto m = static_cast<int64_t>(it - mesh_dim_names.begin());
      TORCH_CHECK_VALUE(!named[m], "placements_from_names: expected each mesh dim named once, got '", name,
                        "' twice");
      TORCH_CHECK_NOT_IMPLEMENTED(m > previous,
                                  "placements_from_names: expected the mesh dims sharding "
                                  "tensor dim ",
                                  d, " in mesh-dim order (outermost first), got '", name, "' after '",
                                  mesh_dim_names[previous], "'");
      named[m] = true;
      previous = m;
      placements[m] = Shard(static_cast<int64_t>(d));
    }
  }
  return placements;
}

namespace {

void check_layout(const char* fn, const std::vector<int64_t>& global_shape,
                  const std::vector<int64_t>& mesh_shape, const std::vector<int64_t>& coordinate,
                  const Placements& placements) {
  TORCH_CHECK(placements.size() == mesh_shape.size(), fn, ": expected one placement per mesh dim (",
              mesh_shape.size(), "), got ", placements.size());
  TORCH_CHECK(coordinate.size() == mesh_shape.size(), fn, ": expected a coordinate of ", mesh_shape.size(),
              " entries, got ", coordinate.size());
  for (const auto& p : placements) {
    if (p.is_shard()) p.normalized(static_cast<int64_t>(global_shape.size()));
  }
}

}  // namespace

std::vector<int64_t> local_shape(const std::vector<int64_t>& global_shape,
                                 const std::vector<int64_t>& mesh_shape,
                                 const std::vector<int64_t>& coordinate, const Placements& placements) {
  check_layout("local_shape", global_shape, mesh_shape, coordinate, placements);
  auto shape = global_shape;
  const auto ndim = static_cast<int64_t>(global_shape.size());
  for (size_t i = 0; i < placements.size(); ++i) {
    if (!placements[i].is_shard()) continue;
    const int64_t d = placements[i].normalized(ndim).dim();
    shape[d] = shard_size(shape[d], mesh_shape[i], coordinate[i]);
  }
  return shape;
}

std::vector<int64_t> local_offset(const std::vector<int64_t>& global_shape,
                                  const std::vector<int64_t>& mesh_shape,
                                  const std::vector<int64_t>& coordinate, const Placements& placements) {
  check_layout("local_offset", global_shape, mesh_shape, coordinate, placements);
  auto shape = global_shape;
  std::vector<int64_t> offset(global_shape.size(), 0);
  const auto ndim = static_cast<int64_t>(global_shape.size());
  for (size_t i = 0; i < placements.size(); ++i) {
    if (!placements[i].is_shard()) continue;
    const int64_t d = placements[i].normalized(ndim).dim();
    offset[d] += shard_offset(shape[d], mesh_shape[i], coordinate[i]);
    shape[d] = shard_size(shape[d], mesh_shape[i], coordinate[i]);
  }
  return offset;
}

}  // namespace hyper_parallel::dtensor
