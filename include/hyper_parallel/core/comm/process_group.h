#pragma once
// Process groups: the world group created from the environment, and sub-groups.
//
// Contract (as in c10d): every rank of the world calls init_process_group, new_group and every
// collective of a group in the same order. Calls that cannot be matched by the other ranks fail
// with a timeout (InitOptions::timeout) rather than hang forever.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>

namespace c10d {
class ProcessGroup;
class Store;
}  // namespace c10d

namespace hyper_parallel::comm {

namespace detail {
struct GroupImpl;
}  // namespace detail

/// Options of init_process_group. Unset fields come from the environment.
///
/// Usage:
///   init_process_group(InitOptions().timeout(std::chrono::seconds(60)));
struct InitOptions {
  /// Global rank; default: RANK, else OMPI_COMM_WORLD_RANK, else SLURM_PROCID.
  TORCH_ARG(std::optional<int64_t>, rank) = std::nullopt;
  /// World size; default: WORLD_SIZE, else OMPI_COMM_WORLD_SIZE, else SLURM_NTASKS.
  TORCH_ARG(std::optional<int64_t>, world_size) = std::nullopt;
  /// Rendezvous host; default: MASTER_ADDR.
  TORCH_ARG(std::optional<std::string>, master_addr) = std::nullopt;
  /// Rendezvous port; default: MASTER_PORT.
  TORCH_ARG(std::optional<int64_t>, master_port) = std::nullopt;
  /// How long rendezvous and every transfer may wait for a peer, on every group (> 0).
  /// Default: HP_TIMEOUT_S seconds if set, else 300 s (init_process_group_from: else each
  /// group's backend's own).
  TORCH_ARG(std::optional<std::chrono::milliseconds>, timeout) = std::nullopt;
  /// Network interface for the transport; default: HP_SOCKET_IFNAME, else the local
  /// address whose route reaches master_addr.
  TORCH_ARG(std::optional<std::string>, interface) = std::nullopt;
};

/// A set of ranks that communicate together. Cheap to copy (a shared handle).
/// A default-constructed Group, or one returned by new_group to a rank outside it, is not a
/// member: every collective on it throws.
class Group {
 public:
  Group() = default;
  explicit Group(std::shared_ptr<detail::GroupImpl> impl) : impl_(std::move(impl)) {}

  bool is_member() const { return impl_ != nullptr; }
  /// This process's rank inside the group (0 .. size()-1).
  int64_t rank() const;
  int64_t size() const;
  /// Global ranks of the members, indexed by group rank.
  const std::vector<int64_t>& global_ranks() const;
  /// A readable name, e.g. "world" or "group1[0,2]".
  const std::string& name() const;
  std::chrono::milliseconds timeout() const;

  detail::GroupImpl& impl() const;  // for this library's communication code

 private:
  std::shared_ptr<detail::GroupImpl> impl_;
};

/// Creates the world group: TCPStore rendezvous on master_addr:master_port, Gloo transport.
/// Throws c10::Error naming the missing variable or bad value.
void init_process_group(const InitOptions& options = {});
/// Joins a world that c10d already made, e.g. the one torch.distributed.init_process_group("gloo")
/// created in Python: the world group runs on `world` itself (no second rendezvous), and
/// sub-groups (new_group, DeviceMesh) are made on `store` (e.g. torch.distributed's default
/// store) with a Gloo transport of their own. Rank and world size come from `world`; the timeout
/// of the world and of every group adopted later from `options`, else HP_TIMEOUT_S, else each
/// backend's own (torch's: the one given to init_process_group or new_group); the interface as
/// in init_process_group. The Python front end calls this; it is
/// the one entry point that names a c10d type, only to pass it through.
void init_process_group_from(c10::intrusive_ptr<c10d::ProcessGroup> world,
                             c10::intrusive_ptr<c10d::Store> store, const InitOptions& options = {});
bool is_initialized();
/// The world group. Throws if init_process_group has not been called.
Group world();
/// Global rank and world size of this process (throws if not initialised).
int64_t global_rank();
int64_t world_size();
/// Releases the world group and every sub-group created since init.
void destroy_process_group();

/// A group that runs on a c10d process group another front end made (e.g. one from
/// torch.distributed.new_group in Python): this library's ops use `backend` itself, and no second
/// group is created. `global_ranks[i]` is group rank i's global rank; this rank must be one of
/// them. The group is called `name` followed by its ranks (e.g. "torch:3[0, 1]"). Adopting the
/// same backend again returns the same Group, so every use shares one call order, one set of tags
/// and one link estimate: the library keeps it (and `backend`) until destroy_process_group, or,
/// once neither the front end nor any handle (the library's own included) holds `backend`,
/// until the next adoption of another group. Its transfers wait with the world's timeout if one
/// was set (InitOptions, HP_TIMEOUT_S, or any C++ world's), else with `backend`'s own (a Gloo
/// backend's; another's: the world's). The world joined by init_process_group_from is already adopted.
Group adopt_group(c10::intrusive_ptr<c10d::ProcessGroup> backend, std::vector<int64_t> global_ranks,
                  const std::string& name);
/// The c10d process group `group` runs on, e.g. to hand an adopted group back to the front end
/// that made it.
c10::intrusive_ptr<c10d::ProcessGroup> backend_of(const Group& group);

/// Creates a group of the given global ranks (distinct, each in [0, world_size)); group rank i
/// is ranks[i].
/// Collective over the world: all ranks call it with the same list, in the same order, even
/// ranks that are not members (they get a non-member Group).
Group new_group(const std::vector<int64_t>& ranks);

}  // namespace hyper_parallel::comm
