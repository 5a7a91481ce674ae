#pragma once
// DeviceMesh: the world's ranks arranged in an n-d grid; each mesh dimension has its own
// communication group (the ranks that differ only in that coordinate).

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <hyper_parallel/core/comm/process_group.h>

namespace hyper_parallel::dtensor {

class DeviceMesh {
 public:
  /// Makes the group of the global ranks of one line of the mesh along one dim; a rank outside
  /// the line gets a non-member Group. Called by every rank for every line, in the same order.
  using GroupFactory = std::function<comm::Group(const std::vector<int64_t>& ranks)>;

  /// Builds a mesh over `ranks` (row-major, shape `shape`). Collective over the world: every
  /// rank calls it with the same arguments (it creates the sub-groups), even ranks outside it.
  /// Usually made through init_device_mesh. A line that is the whole world, in order, runs on
  /// the world group; the other lines' groups come from `make_group` (default comm::new_group;
  /// the Python front end passes one that makes torch.distributed groups).
  DeviceMesh(std::string device_type, std::vector<int64_t> shape, std::vector<int64_t> ranks,
             std::vector<std::string> dim_names = {}, const GroupFactory& make_group = {});

  /// The 1-d mesh whose one line is `group` (a member's), named `dim_name` if given. It makes no
  /// group, so it is not collective: any rank of the group may make it at any time (the Python
  /// front end makes one for a mesh of another library that offers get_group() and size()).
  static DeviceMesh from_group(const comm::Group& group, const std::string& dim_name = "");

  const std::string& device_type() const;
  int64_t ndim() const;
  const std::vector<int64_t>& shape() const;
  /// Size of mesh dim `mesh_dim` (negative counts from the end).
  int64_t size(int64_t mesh_dim) const;
  /// Number of ranks in the mesh.
  int64_t size() const;
  const std::vector<std::string>& dim_names() const;
  /// Index of the mesh dim called `name`; throws naming the known names otherwise.
  int64_t dim_index(const std::string& name) const;
  /// Group of the ranks that share every coordinate of this rank except `mesh_dim`.
  comm::Group get_group(int64_t mesh_dim) const;
  /// The group of a 1-d mesh; on an n-d mesh a c10::ValueError asking for the dim (as PyTorch's
  /// get_group() without mesh_dim).
  comm::Group get_group() const;
  comm::Group get_group(const std::string& name) const;
  /// This rank's coordinate along `mesh_dim` (= its rank in get_group(mesh_dim)).
  int64_t get_local_rank(int64_t mesh_dim) const;
  /// The same on a 1-d mesh (a c10::ValueError on another, as torch's get_local_rank() without
  /// mesh_dim).
  int64_t get_local_rank() const;
  const std::vector<int64_t>& coordinate() const;
  /// The mesh's ranks, row-major.
  const std::vector<int64_t>& ranks() const;
  /// The 1-d mesh along the dim called `name` that contains this rank (no new groups).
  DeviceMesh operator[](const std::string& name) const;
  /// The mesh along the dims called `names`, in that order, that contains this rank (no new
  /// groups), e.g. mesh[{"replicate", "shard"}] of a {replicate, shard, tp} mesh.
  DeviceMesh operator[](const std::vector<std::string>& names) const;
  /// The same by dim index; `dims` in any order (all of them: the mesh with its dims permuted).
  DeviceMesh sub_mesh(const std::vector<int64_t>& dims) const;
  /// The mesh whose dims are `outer`'s then `inner`'s, when both are sub-meshes of one mesh
  /// (init_device_mesh's, sliced) along distinct dims; nullopt otherwise. Placements on it nest
  /// in that order: e.g. fully_shard's Shard(0) over dp applies to a parameter's TP shard.
  static std::optional<DeviceMesh> concatenate(const DeviceMesh& outer, const DeviceMesh& inner);

  /// Makes this mesh the current one of this thread (`with mesh:` in Python) until the matching
  /// exit(); entries nest. For the calls whose mesh is optional (distribute_tensor, from_local,
  /// the DTensor factories of the Python package), as PyTorch's.
  void enter() const;
  /// Ends the innermost enter() of this thread, which must be this mesh's.
  void exit() const;
  /// The mesh of this thread's innermost enter(); a ValueError if there is none.
  static DeviceMesh current();

  /// The same ranks along the same dims of one mesh (a slice made twice is equal to itself).
  bool operator==(const DeviceMesh& other) const;
  bool operator!=(const DeviceMesh& other) const { return !(*this == other); }
  std::string str() const;

 private:
  struct Impl;
  explicit DeviceMesh(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  int64_t normalize_mesh_dim(const char* fn, int64_t mesh_dim) const;
  // The mesh this one is a sub-mesh of (itself if none), and the dims of it this one's are.
  std::shared_ptr<const Impl> root_impl() const;
  std::vector<int64_t> root_dims() const;
  std::shared_ptr<const Impl> impl_;
};

/// A mesh over the whole world (product of mesh_shape must equal the world size), ranks in
/// row-major order. device_type must be "cpu" in this build.
///
/// Usage:
///   auto mesh = init_device_mesh("cpu", {2, 4}, {"dp", "tp"});
///   auto tp = mesh["tp"];
DeviceMesh init_device_mesh(const std::string& device_type, const std::vector<int64_t>& mesh_shape,
                            const std::vector<std::string>& mesh_dim_names = {},
                            const DeviceMesh::GroupFactory& make_group = {});

}  // namespace hyper_parallel::dtensor
