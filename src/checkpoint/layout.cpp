#include "layout.h"

#include <algorithm>
#include <sstream>

#include <c10/util/Exception.h>

namespace hyper_parallel::checkpoint::detail {

std::string shape_str(const std::vector<int64_t>& shape) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << "]";
  return s.str();
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto v : shape) n *= v;
  return n;
}

int64_t Region::numel() const { return numel_of(shape); }

Region local_region(const char* fn, const std::string& key, const Entry& entry) {
  Region r{std::vector<int64_t>(entry.global_shape.size(), 0), entry.global_shape};
  if (!entry.mesh) {
    TORCH_CHECK(entry.placements.empty(), fn, ": ", key, ": expected no placements without a ", "mesh, got ",
                dtensor::to_string(entry.placements));
    return r;
  }
  const auto& mesh = *entry.mesh;
  TORCH_CHECK(static_cast<int64_t>(entry.placements.size()) == mesh.ndim(), fn, ": ", key,
              ": expected one placement per mesh dim (", mesh.ndim(), "), got ",
              dtensor::to_string(entry.placements));
  for (const auto& p : entry.placements) {
    TORCH_CHECK(!p.is_partial(), fn, ": ", key, ": expected Shard or Replicate placements, got ",
                dtensor::to_string(entry.placements),
                " (a Partial value must be reduced before it is saved)");
  }
  if (entry.is_replicated()) return r;
  r.offset = dtensor::local_offset(entry.global_shape, mesh.shape(), mesh.coordinate(), entry.placements);
  r.shape = dtensor::local_shape(entry.global_shape, mesh.shape(), mesh.coordinate(), entry.placements);
  return r;
}

Region intersect(const Region& a, const Region& b) {
  TORCH_INTERNAL_ASSERT(a.shape.size() == b.shape.size(), "intersect: regions of different rank");
  Region r{std::vector<int64_t>(a.shape.size()), std::vector<int64_t>(a.shape.size())};
  for (size_t d = 0; d < a.shape.size(); ++d) {
    const int64_t lo = std::max(a.offset[d], b.offset[d]);
    const int64_t hi = std::min(a.offset[d] + a.shape[d], b.offset[d] + b.shape[d]);
    r.offset[d] = lo;
    r.shape[d] = std::max<int64_t>(0, hi - lo);
  }
  return r;
}

bool overlaps(const Region& a, const Region& b) { return intersect(a, b).numel() > 0; }

}  // namespace hyper_parallel::checkpoint::detail
