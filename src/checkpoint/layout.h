#pragma once
// Which part of a global tensor an Entry holds on this rank, and the region arithmetic save and
// load share.

#include <cstdint>
#include <string>
#include <vector>

#include <hyper_parallel/checkpoint/checkpoint.h>

namespace hyper_parallel::checkpoint::detail {

/// "[2, 3]" for messages.
std::string shape_str(const std::vector<int64_t>& shape);
/// The product of the extents (1 for a scalar's []).
int64_t numel_of(const std::vector<int64_t>& shape);

/// A box of a global tensor: [offset, offset + shape) per dim.
struct Region {
  std::vector<int64_t> offset, shape;
  int64_t numel() const;
  bool operator==(const Region& other) const { return offset == other.offset && shape == other.shape; }
};

/// The region `entry` holds on this rank: the whole tensor if it is replicated, else the shard
/// its mesh coordinate gives (dtensor::local_offset / local_shape). Throws, naming `key`, for a
/// Partial placement or a placement list that does not fit the mesh.
Region local_region(const char* fn, const std::string& key, const Entry& entry);

/// The intersection of two regions of one tensor (numel() == 0 when they do not meet).
Region intersect(const Region& a, const Region& b);

/// True if two regions share at least one element.
bool overlaps(const Region& a, const Region& b);

}  // namespace hyper_parallel::checkpoint::detail
