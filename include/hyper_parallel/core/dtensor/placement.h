#pragma once
// Placements: how a DTensor's global value is laid out over one mesh dimension.
//   Shard(d)       each rank holds chunk `coordinate` of tensor dim d (torch.chunk sizes)
//   Replicate()    each rank holds the whole value
//   Partial(op)    the value is the sum (or mean) over ranks of the local tensors

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <hyper_parallel/core/comm/chunks.h>
#include <hyper_parallel/core/comm/collectives.h>

namespace hyper_parallel::dtensor {

class Placement {
 public:
  enum class Kind { kShard, kReplicate, kPartial };

  static Placement shard(int64_t dim) { return Placement(Kind::kShard, dim, comm::ReduceOp::kSum); }
  static Placement replicate() { return Placement(Kind::kReplicate, 0, comm::ReduceOp::kSum); }
  static Placement partial(comm::ReduceOp op = comm::ReduceOp::kSum) {
    return Placement(Kind::kPartial, 0, op);
  }

  Kind kind() const { return kind_; }
  bool is_shard() const { return kind_ == Kind::kShard; }
  bool is_shard(int64_t dim) const { return kind_ == Kind::kShard && dim_ == dim; }
  bool is_replicate() const { return kind_ == Kind::kReplicate; }
  bool is_partial() const { return kind_ == Kind::kPartial; }
  /// The tensor dim of a Shard (may be negative until normalized).
  int64_t dim() const;
  comm::ReduceOp reduce_op() const;

  /// Shard(d) with d in [0, ndim); throws if d is out of range for a tensor of `ndim` dims.
  Placement normalized(int64_t ndim) const;
  /// The placement of a gradient flowing back into this one: Partial becomes Replicate.
  Placement for_gradient() const { return is_partial() ? replicate() : *this; }

  std::string str() const;  // "Shard(1)", "Replicate()", "Partial(sum)"
  bool operator==(const Placement& other) const;
  bool operator!=(const Placement& other) const { return !(*this == other); }

 private:
  Placement(Kind kind, int64_t dim, comm::ReduceOp op) : kind_(kind), dim_(dim), op_(op) {}
  Kind kind_;
  int64_t dim_;
  comm::ReduceOp op_;
};

using Placements = std::vector<Placement>;

// Spelled like torch.distributed.tensor's placements.
inline Placement Shard(int64_t dim) { return Placement::shard(dim); }
inline Placement Replicate() { return Placement::replicate(); }
inline Placement Partial(comm::ReduceOp op = comm::ReduceOp::kSum) { return Placement::partial(op); }

std::string to_string(const Placements& placements);  // "[Shard(0), Replicate()]"

/// The placements the original's layout names spell: for each tensor dim, the names of the mesh
/// dims that shard it ("None" or none: not sharded; several nest with the first outermost, so
/// they must come in mesh-dim order), one name per mesh dim at most; a mesh dim named nowhere
/// replicates. E.g. on a ("dp", "tp") mesh, {{"dp"}, {"None"}} is [Shard(0), Replicate()] and
/// {{"dp", "tp"}, {"None"}} is [Shard(0), Shard(0)]. `tensor_dims` has one entry per dim of a
/// tensor of `ndim` dims.
Placements placements_from_names(const std::vector<std::vector<std::string>>& tensor_dims,
                                 const std::vector<std::string>& mesh_dim_names, int64_t ndim);

// ---- Shard arithmetic (torch.chunk semantics; no communication) ----

/// Extent of shard `index` when `global` is split into `parts`: torch.chunk sizes
/// (comm::chunk_size), e.g. global 5, parts 4 -> 2, 2, 1, 0.
inline int64_t shard_size(int64_t global, int64_t parts, int64_t index) {
  return comm::chunk_size(global, parts, index);
}
/// Start of shard `index` along the dim.
inline int64_t shard_offset(int64_t global, int64_t parts, int64_t index) {
  return comm::chunk_offset(global, parts, index);
}

/// Local shape of a DTensor on the rank at `coordinate` of a mesh of `mesh_shape`. Several mesh
/// dims sharding one tensor dim nest in mesh-dim order (mesh dim 0 outermost).
std::vector<int64_t> local_shape(const std::vector<int64_t>& global_shape,
                                 const std::vector<int64_t>& mesh_shape,
                                 const std::vector<int64_t>& coordinate, const Placements& placements);
/// Offset of that local shard inside the global tensor, per tensor dim.
std::vector<int64_t> local_offset(const std::vector<int64_t>& global_shape,
                                  const std::vector<int64_t>& mesh_shape,
                                  const std::vector<int64_t>& coordinate, const Placements& placements);

}  // namespace hyper_parallel::dtensor
