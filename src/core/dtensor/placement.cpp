#include <hyper_parallel/core/dtensor/placement.h>

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
