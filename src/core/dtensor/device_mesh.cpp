#include <hyper_parallel/core/dtensor/device_mesh.h>

#include <algorithm>
#include <numeric>
#include <optional>
#include <sstream>

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

namespace hyper_parallel::dtensor {

struct DeviceMesh::Impl {
  std::string device_type;
  std::vector<int64_t> shape;
  std::vector<int64_t> ranks;  // row-major
  std::vector<std::string> dim_names;
  std::vector<int64_t> coordinate;  // of this rank; empty if not in the mesh
  std::vector<comm::Group> groups;  // one per mesh dim
  // A sub-mesh's mesh (null: this is one) and the dims of it that this mesh's dims are.
  std::shared_ptr<const Impl> root;
  std::vector<int64_t> root_dims;
};

namespace {

std::vector<int64_t> strides_of(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i) {
    strides[i] = strides[i + 1] * shape[i + 1];
  }
  return strides;
}

// The lines of `ranks` (row-major, shape `shape`) along mesh dim `d`: the ranks that differ only
// in coordinate d, in that coordinate's order; the lines in row-major order of their first ranks.
std::vector<std::vector<int64_t>> lines_along(const std::vector<int64_t>& shape,
                                              const std::vector<int64_t>& ranks, size_t d) {
  const auto strides = strides_of(shape);
  std::vector<std::vector<int64_t>> lines;
  for (size_t start = 0; start < ranks.size(); ++start) {
    if ((static_cast<int64_t>(start) / strides[d]) % shape[d] != 0) continue;  // not the first of its line
    std::vector<int64_t> line;
    for (int64_t k = 0; k < shape[d]; ++k) line.push_back(ranks[start + k * strides[d]]);
    lines.push_back(std::move(line));
  }
  return lines;
}

// Every line along every mesh dim in ascending rank order, checked by every rank before any group
// is made: torch.distributed orders a group's ranks, and a coordinate must be the rank in its group.
void check_lines_ascend(const std::vector<int64_t>& shape, const std::vector<int64_t>& ranks) {
  for (size_t d = 0; d < shape.size(); ++d) {
    for (const auto& line : lines_along(shape, ranks, d)) {
      TORCH_CHECK_VALUE(std::is_sorted(line.begin(), line.end()),
                        "DeviceMesh: expected each line of ranks along ",
                        "a mesh dim in ascending order (torch.distributed orders a group's ranks, and a "
                        "coordinate must be the rank in its group), got the line ",
                        c10::IntArrayRef(line), " along mesh dim ", d);
    }
  }
}

// The constructor's arguments, checked before any group is made (user errors: ValueError).
void check_mesh_arguments(const std::string& device_type, const std::vector<int64_t>& shape,
                          const std::vector<int64_t>& ranks, const std::vector<std::string>& dim_names) {
  TORCH_CHECK_VALUE(device_type == "cpu", "DeviceMesh: device_type '", device_type,
                    "' is not supported by this build (Gloo transport); expected 'cpu'");
  TORCH_CHECK_VALUE(!shape.empty(), "DeviceMesh: expected a mesh shape with at least 1 dim, got []");
  for (size_t i = 0; i < shape.size(); ++i) {
    TORCH_CHECK_VALUE(shape[i] >= 1, "DeviceMesh: expected mesh_shape[", i, "] >= 1, got ", shape[i]);
  }
  const int64_t numel = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
  TORCH_CHECK_VALUE(static_cast<int64_t>(ranks.size()) == numel, "DeviceMesh: expected ", numel,
                    " ranks for mesh shape ", c10::IntArrayRef(shape), ", got ", ranks.size());
  TORCH_CHECK_VALUE(dim_names.empty() || dim_names.size() == shape.size(),
                    "DeviceMesh: expected one name per mesh dim (", shape.size(), "), got ",
                    dim_names.size());
  for (size_t i = 0; i < dim_names.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      TORCH_CHECK_VALUE(dim_names[i] != dim_names[j], "DeviceMesh: expected distinct dim names, got '",
                        dim_names[i], "' twice");
    }
  }
  check_lines_ascend(shape, ranks);
  const int64_t world = comm::world_size();  // throws if not initialised
  std::vector<bool> seen(world, false);
  for (int64_t r : ranks) {
    TORCH_CHECK_VALUE(r >= 0 && r < world, "DeviceMesh: expected ranks in [0, ", world, "), got ", r);
    TORCH_CHECK_VALUE(!seen[r], "DeviceMesh: expected each rank once, got rank ", r, " twice");
    seen[r] = true;
  }
}

}  // namespace

DeviceMesh::DeviceMesh(std::string device_type, std::vector<int64_t> shape, std::vector<int64_t> ranks,
                       std::vector<std::string> dim_names, const GroupFactory& make_group) {
  check_mesh_arguments(device_type, shape, ranks, dim_names);
  const int64_t world = comm::world_size();
  auto impl = std::make_shared<Impl>();
  impl->device_type = std::move(device_type);
  impl->shape = std::move(shape);
  impl->ranks = std::move(ranks);
  impl->dim_names = std::move(dim_names);
  const auto strides = strides_of(impl->shape);
  const int64_t me = comm::global_rank();
  auto pos = std::find(impl->ranks.begin(), impl->ranks.end(), me);
  if (pos != impl->ranks.end()) {
    int64_t flat = pos - impl->ranks.begin();
    for (size_t i = 0; i < impl->shape.size(); ++i) {
      impl->coordinate.push_back(flat / strides[i]);
      flat %= strides[i];
    }
  }
  const int64_t ndim = static_cast<int64_t>(impl->shape.size());
  impl->groups.resize(ndim);
  // One group per line along each mesh dim, created by every rank in the same order (the
  // new_group contract). The whole world in order reuses the world group.
  std::vector<int64_t> everyone(world);
  std::iota(everyone.begin(), everyone.end(), 0);
  for (int64_t d = 0; d < ndim; ++d) {
    for (const auto& line : lines_along(impl->shape, impl->ranks, d)) {
      comm::Group g = line == everyone ? comm::world()
                      : make_group     ? make_group(line)
                                       : comm::new_group(line);
      if (!g.is_member()) continue;
      // A coordinate along the line must be the rank in its group (collectives order by it).
      TORCH_CHECK_VALUE(g.global_ranks() == line, "DeviceMesh: expected the group of the line ",
                        c10::IntArrayRef(line), " to keep that order, got a group of ranks ",
                        c10::IntArrayRef(g.global_ranks()),
                        " (torch.distributed orders a group's ranks: lay each line out in ascending order)");
      impl->groups[d] = g;
    }
  }
  impl_ = std::move(impl);
}

namespace {
// The meshes this thread entered, innermost last (`with mesh:`).
thread_local std::vector<DeviceMesh> entered_meshes;
}  // namespace

void DeviceMesh::enter() const { entered_meshes.push_back(*this); }

void DeviceMesh::exit() const {
  TORCH_CHECK_VALUE(!entered_meshes.empty() && entered_meshes.back() == *this,
                    "DeviceMesh::exit: expected the innermost mesh this thread entered, got ", str(),
                    entered_meshes.empty() ? " with none entered" : " while another is innermost");
  entered_meshes.pop_back();
}

DeviceMesh DeviceMesh::current() {
  TORCH_CHECK_VALUE(!entered_meshes.empty(),
                    "DeviceMesh::current: expected a mesh entered on this thread (`with mesh:`), got none");
  return entered_meshes.back();
}

DeviceMesh DeviceMesh::from_group(const comm::Group& group, const std::string& dim_name) {
  TORCH_CHECK_VALUE(group.is_member(),
                    "DeviceMesh::from_group: expected a group this rank belongs to, got a "
                    "non-member group");
  // Built directly: the mesh's one line is this very group, even where it spans the whole world.
  auto impl = std::make_shared<Impl>();
  impl->device_type = "cpu";
  impl->shape = {group.size()};
  impl->ranks = group.global_ranks();
  if (!dim_name.empty()) impl->dim_names = {dim_name};
  impl->coordinate = {group.rank()};
  impl->groups = {group};
  return DeviceMesh(std::shared_ptr<const Impl>(std::move(impl)));
}

const std::string& DeviceMesh::device_type() const { return impl_->device_type; }
int64_t DeviceMesh::ndim() const { return static_cast<int64_t>(impl_->shape.size()); }
const std::vector<int64_t>& DeviceMesh::shape() const { return impl_->shape; }
int64_t DeviceMesh::size() const { return static_cast<int64_t>(impl_->ranks.size()); }
const std::vector<std::string>& DeviceMesh::dim_names() const { return impl_->dim_names; }
const std::vector<int64_t>& DeviceMesh::ranks() const { return impl_->ranks; }

int64_t DeviceMesh::normalize_mesh_dim(const char* fn, int64_t mesh_dim) const {
  const int64_t n = ndim();
  TORCH_CHECK(mesh_dim >= -n && mesh_dim < n, "DeviceMesh::", fn, ": expected mesh dim in [", -n, ", ", n,
              "), got ", mesh_dim);
  return mesh_dim < 0 ? mesh_dim + n : mesh_dim;
}

int64_t DeviceMesh::size(int64_t mesh_dim) const {
  return impl_->shape[normalize_mesh_dim("size", mesh_dim)];
}

int64_t DeviceMesh::dim_index(const std::string& name) const {
  const auto& names = impl_->dim_names;
  auto it = std::find(names.begin(), names.end(), name);
  if (it == names.end()) {
    std::ostringstream known;
    for (size_t i = 0; i < names.size(); ++i) known << (i ? ", " : "") << "'" << names[i] << "'";
    TORCH_CHECK(false, "DeviceMesh::dim_index: expected one of the mesh dim names [", known.str(), "], got '",
                name, "'");
  }
  return it - names.begin();
}

const std::vector<int64_t>& DeviceMesh::coordinate() const {
  TORCH_CHECK(!impl_->coordinate.empty(), "DeviceMesh::coordinate: expected a rank of ", str(), " (ranks ",
              c10::IntArrayRef(impl_->ranks), "), got rank ", comm::global_rank());
  return impl_->coordinate;
}

comm::Group DeviceMesh::get_group(int64_t mesh_dim) const {
  const auto d = normalize_mesh_dim("get_group", mesh_dim);
  coordinate();  // throws for ranks outside the mesh
  return impl_->groups[d];
}

comm::Group DeviceMesh::get_group() const {
  TORCH_CHECK_VALUE(ndim() == 1, "DeviceMesh::get_group: expected mesh_dim for the ", ndim(), "-d mesh ",
                    str(), " (a name or an index), got none");
  return get_group(0);
}

comm::Group DeviceMesh::get_group(const std::string& name) const { return get_group(dim_index(name)); }

int64_t DeviceMesh::get_local_rank(int64_t mesh_dim) const {
  return coordinate()[normalize_mesh_dim("get_local_rank", mesh_dim)];
}

int64_t DeviceMesh::get_local_rank() const {
  TORCH_CHECK_VALUE(ndim() == 1, "DeviceMesh::get_local_rank: expected mesh_dim for the ", ndim(), "-d mesh ",
                    str(), " (a name or an index), got none");
  return get_local_rank(0);
}

DeviceMesh DeviceMesh::operator[](const std::string& name) const { return sub_mesh({dim_index(name)}); }

DeviceMesh DeviceMesh::operator[](const std::vector<std::string>& names) const {
  std::vector<int64_t> dims;
  dims.reserve(names.size());
  for (const auto& name : names) dims.push_back(dim_index(name));
  return sub_mesh(dims);
}

DeviceMesh DeviceMesh::sub_mesh(const std::vector<int64_t>& dims_in) const {
  std::vector<int64_t> dims;
  for (int64_t d : dims_in) {
    const int64_t n = normalize_mesh_dim("sub_mesh", d);
    TORCH_CHECK_VALUE(std::find(dims.begin(), dims.end(), n) == dims.end(),
                      "DeviceMesh::sub_mesh: expected distinct mesh dims, got ", c10::IntArrayRef(dims_in));
    dims.push_back(n);
  }
  TORCH_CHECK_VALUE(!dims.empty(), "DeviceMesh::sub_mesh: expected at least one mesh dim, got none");
  const auto& coord = coordinate();
  const auto strides = strides_of(impl_->shape);
  auto sub = std::make_shared<Impl>();
  sub->device_type = impl_->device_type;
  // This rank's line: the other dims stay at this rank's coordinate.
  int64_t base = 0;
  for (int64_t i = 0; i < ndim(); ++i) {
    if (std::find(dims.begin(), dims.end(), i) == dims.end()) base += coord[i] * strides[i];
  }
  for (int64_t d : dims) {
    sub->shape.push_back(impl_->shape[d]);
    if (!impl_->dim_names.empty()) sub->dim_names.push_back(impl_->dim_names[d]);
    sub->coordinate.push_back(coord[d]);
    sub->groups.push_back(impl_->groups[d]);
    sub->root_dims.push_back(impl_->root ? impl_->root_dims[d] : d);
  }
  const auto sub_strides = strides_of(sub->shape);
  const int64_t numel =
      std::accumulate(sub->shape.begin(), sub->shape.end(), int64_t{1}, std::multiplies<>());
  for (int64_t k = 0; k < numel; ++k) {
    int64_t index = base;
    for (size_t j = 0; j < dims.size(); ++j) index += (k / sub_strides[j]) % sub->shape[j] * strides[dims[j]];
    sub->ranks.push_back(impl_->ranks[index]);
  }
  sub->root = impl_->root ? impl_->root : impl_;
  return DeviceMesh(std::shared_ptr<const Impl>(std::move(sub)));
}

std::shared_ptr<const DeviceMesh::Impl> DeviceMesh::root_impl() const {
  return impl_->root ? impl_->root : impl_;
}

std::vector<int64_t> DeviceMesh::root_dims() const {
  if (impl_->root) return impl_->root_dims;
  std::vector<int64_t> all(impl_->shape.size());
  std::iota(all.begin(), all.end(), 0);
  return all;
}

bool DeviceMesh::operator==(const DeviceMesh& other) const {
  return impl_ == other.impl_ || (root_impl() == other.root_impl() && root_dims() == other.root_dims() &&
                                  impl_->coordinate == other.impl_->coordinate);
}

std::optional<DeviceMesh> DeviceMesh::concatenate(const DeviceMesh& outer, const DeviceMesh& inner) {
  if (outer.root_impl() != inner.root_impl()) return std::nullopt;
  auto dims = outer.root_dims();
  for (int64_t d : inner.root_dims()) {
    if (std::find(dims.begin(), dims.end(), d) != dims.end()) return std::nullopt;
    dims.push_back(d);
  }
  return DeviceMesh(outer.root_impl()).sub_mesh(dims);
}

std::string DeviceMesh::str() const {
  std::ostringstream s;
  s << "DeviceMesh('" << impl_->device_type << "', shape=" << c10::IntArrayRef(impl_->shape);
  if (!impl_->dim_names.empty()) {
    s << ", names=(";
    for (size_t i = 0; i < impl_->dim_names.size(); ++i) s << (i ? ", " : "") << impl_->dim_names[i];
    s << ")";
  }
  s << ")";
  return s.str();
}

DeviceMesh init_device_mesh(const std::string& device_type, const std::vector<int64_t>& mesh_shape,
                            const std::vector<std::string>& mesh_dim_names,
                            const DeviceMesh::GroupFactory& make_group) {
  TORCH_CHECK(comm::is_initialized(),
              "init_device_mesh: process group is not initialised; call "
              "init_process_group() first");
  const int64_t world = comm::world_size();
  const int64_t numel =
      std::accumulate(mesh_shape.begin(), mesh_shape.end(), int64_t{1}, std::multiplies<>());
  TORCH_CHECK(numel == world, "init_device_mesh: expected mesh_shape ", c10::IntArrayRef(mesh_shape),
              " to hold the world size ", world, ", got ", numel, " ranks");
  std::vector<int64_t> ranks(world);
  std::iota(ranks.begin(), ranks.end(), 0);
  return DeviceMesh(device_type, mesh_shape, std::move(ranks), mesh_dim_names, make_group);
}

}  // namespace hyper_parallel::dtensor
