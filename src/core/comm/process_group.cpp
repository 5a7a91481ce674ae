#include <hyper_parallel/core/comm/process_group.h>

#include <cstdlib>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <utility>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupWrapper.hpp>

#include <hyper_parallel/core/comm/lifecycle.h>
#include <hyper_parallel/core/comm/trace.h>

#include "env.h"
#include "flight_recorder.h"
#include "group_impl.h"
#include "worker_thread.h"
#include "world_store.h"

namespace hyper_parallel::comm {
namespace {

using detail::env;
using detail::int_from_env;
using detail::local_address_towards;
using detail::parse_int;
using detail::world_store;

// Every environment variable this file reads is init_process_group's (or its adopting twin's).
constexpr const char* kInit = "hyper_parallel::comm::init_process_group";
constexpr std::chrono::milliseconds kDefaultTimeout = std::chrono::seconds(300);

struct World {
  std::mutex mutex;
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<::gloo::transport::Device> device;
  std::shared_ptr<detail::GroupImpl> group;
  int64_t groups_created = 0;  // sub-groups, same count on every rank (collective contract)
  // Adopted backends (the world joined from torch among them) and their groups, kept while the
  // front end keeps the backend: a group's call order, tags and link estimate outlive the
  // handles, which each rank may drop at a different time (Python's collector decides when).
  std::map<const c10d::ProcessGroup*, std::shared_ptr<detail::GroupImpl>> adopted;
  // The timeout every adopted group waits with, if init_process_group_from's options or
  // HP_TIMEOUT_S set one; else each waits with its backend's own.
  std::optional<std::chrono::milliseconds> adopted_timeout;
  std::thread::id init_thread;  // the thread that made or joined the world
  // The master of the world's store, if it is a TCPStore: where control channels meet.
  std::optional<std::pair<std::string, uint16_t>> store_master;
};

World& world_state() {
  static World w;
  return w;
}

std::optional<std::chrono::milliseconds> timeout_set(const InitOptions& options, const char* fn) {
  if (options.timeout()) {
    TORCH_CHECK_VALUE(options.timeout()->count() > 0, "hyper_parallel::comm::", fn,
                      ": expected a timeout > 0, got ", options.timeout()->count(), " ms");
    return options.timeout();
  }
  if (auto v = env("HP_TIMEOUT_S")) {
    int64_t s = parse_int(*v, "HP_TIMEOUT_S", kInit);
    TORCH_CHECK(s > 0, "hyper_parallel::comm::", fn, ": expected HP_TIMEOUT_S > 0, got ", s);
    return std::chrono::seconds(s);
  }
  return std::nullopt;
}

// The Gloo backend under a backend another front end made (TORCH_DISTRIBUTED_DEBUG=DETAIL wraps
// each of torch's groups in a checking one), or null if it is not Gloo.
c10d::ProcessGroupGloo* gloo_of(const c10::intrusive_ptr<c10d::ProcessGroup>& backend) {
  if (auto* wrapper = dynamic_cast<c10d::ProcessGroupWrapper*>(backend.get()))
    return dynamic_cast<c10d::ProcessGroupGloo*>(wrapper->getWrappedPg().get());
  return dynamic_cast<c10d::ProcessGroupGloo*>(backend.get());
}

// The timeout a backend another front end made waits with (torch: the one given to
// init_process_group or new_group, 30 min unless given), or `fallback` if it tells none.
std::chrono::milliseconds own_timeout(const c10::intrusive_ptr<c10d::ProcessGroup>& backend,
                                      std::chrono::milliseconds fallback) {
  auto* gloo = gloo_of(backend);
  if (gloo == nullptr) return fallback;
  const auto timeout = gloo->getOptions()->timeout;
  return timeout.count() > 0 ? timeout : fallback;
}

// The master of a TCPStore under any PrefixStores, if the store is one.
std::optional<std::pair<std::string, uint16_t>> tcp_master(c10::intrusive_ptr<c10d::Store> store) {
  while (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(store.get()))
    store = prefixed->getUnderlyingStore();
  auto* tcp = dynamic_cast<c10d::TCPStore*>(store.get());
  if (tcp == nullptr) return std::nullopt;
  return std::make_pair(tcp->getHost(), tcp->getPort());
}

// The transport device of a Gloo backend another front end made (torch's follows
// GLOO_SOCKET_IFNAME), or `fallback` if it tells none.
std::shared_ptr<::gloo::transport::Device> own_device(const c10::intrusive_ptr<c10d::ProcessGroup>& backend,
                                                      std::shared_ptr<::gloo::transport::Device> fallback) {
  auto* gloo = gloo_of(backend);
  if (gloo == nullptr || gloo->getOptions()->devices.empty()) return fallback;
  return gloo->getOptions()->devices.front();
}

// Where a group's control channel meets (group_impl.h), over `device`; none without a TCPStore.
std::optional<detail::ControlRendezvous> control_rendezvous(
    const World& w, std::shared_ptr<::gloo::transport::Device> device) {
  if (!w.store_master) return std::nullopt;
  return detail::ControlRendezvous{w.store_master->first, w.store_master->second, std::move(device)};
}

// Destroys groups on a thread of this library's own: a ProcessGroupGloo's destructor joins its
// threads, which may be the caller (a callback of its work) or wait for the caller (Python's
// lock, which a callback needs). The future is ready once they are destroyed.
std::shared_future<void> release_on_own_thread(std::vector<std::shared_ptr<detail::GroupImpl>> groups) {
  auto released = std::make_shared<std::promise<void>>();
  std::shared_future<void> done = released->get_future().share();
  if (groups.empty()) {
    released->set_value();
    return done;
  }
  static auto* releaser = new detail::WorkerThread();  // never freed: it may outlive statics
  releaser->submit([groups = std::move(groups), released]() mutable {
    groups.clear();
    released->set_value();
  });
  return done;
}

detail::GroupImpl& require_world(const char* fn) {
  auto& w = world_state();
  TORCH_CHECK(w.group != nullptr, "hyper_parallel::comm::", fn,
              ": process group is not initialised; call init_process_group() first");
  return *w.group;
}

}  // namespace

int64_t Group::rank() const { return impl().rank; }
int64_t Group::size() const { return static_cast<int64_t>(impl().global_ranks.size()); }
const std::vector<int64_t>& Group::global_ranks() const { return impl().global_ranks; }
const std::string& Group::name() const { return impl().name; }
std::chrono::milliseconds Group::timeout() const { return impl().timeout; }

detail::GroupImpl& Group::impl() const {
  TORCH_CHECK(impl_ != nullptr,
              "hyper_parallel::comm::Group: expected a group this rank is a member of, got a "
              "non-member (default-constructed or from new_group without this rank)");
  return *impl_;
}

void init_process_group(const InitOptions& options) {
  auto& w = world_state();
  std::lock_guard<std::mutex> lock(w.mutex);
  TORCH_CHECK(w.group == nullptr,
              "hyper_parallel::comm::init_process_group: already initialised; call "
              "destroy_process_group() first");

  auto rank =
      options.rank() ? options.rank() : int_from_env({"RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"}, kInit);
  auto size = options.world_size()
                  ? options.world_size()
                  : int_from_env({"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"}, kInit);
  TORCH_CHECK(rank.has_value(),
              "hyper_parallel::comm::init_process_group: expected the rank in RANK (or "
              "OMPI_COMM_WORLD_RANK / SLURM_PROCID), got none; launch with hp-run");
  TORCH_CHECK(size.has_value(),
              "hyper_parallel::comm::init_process_group: expected the world size in WORLD_SIZE "
              "(or OMPI_COMM_WORLD_SIZE / SLURM_NTASKS), got none; launch with hp-run");
  TORCH_CHECK(*size >= 1, "hyper_parallel::comm::init_process_group: expected world size >= 1, got ", *size);
  TORCH_CHECK(*rank >= 0 && *rank < *size, "hyper_parallel::comm::init_process_group: expected rank in [0, ",
              *size, "), got ", *rank);
  auto addr = options.master_addr() ? options.master_addr() : env("MASTER_ADDR");
  TORCH_CHECK(addr.has_value(),
              "hyper_parallel::comm::init_process_group: expected MASTER_ADDR to be set, got none");
  std::optional<int64_t> port = options.master_port();
  if (!port) {
    auto text = env("MASTER_PORT");
    TORCH_CHECK(text.has_value(),
                "hyper_parallel::comm::init_process_group: expected MASTER_PORT to be set, got "
                "none");
    port = parse_int(*text, "MASTER_PORT", kInit);
  }
  TORCH_CHECK(*port > 0 && *port < 65536,
              "hyper_parallel::comm::init_process_group: expected MASTER_PORT in [1, 65535], got ", *port);
  auto timeout = timeout_set(options, "init_process_group").value_or(kDefaultTimeout);

  // Before the store: its client's thread terminates the process if its listener resets it.
  detail::install_stop_report(*rank);
  // Until the world's backend is made, which needs rank 0's keys: then the store is rank 0's.
  std::optional<detail::JoiningStoreNote> joining;
  if (*rank != 0) joining.emplace(*addr + ":" + std::to_string(*port));
  w.store = world_store(*addr, static_cast<uint16_t>(*port), *rank, *size, timeout);

  auto iface = options.interface() ? options.interface() : env("HP_SOCKET_IFNAME");
  w.device = iface ? c10d::ProcessGroupGloo::createDeviceForInterface(*iface)
                   : c10d::ProcessGroupGloo::createDeviceForHostname(local_address_towards(*addr, *port));

  auto gloo_options = c10d::ProcessGroupGloo::Options::create(timeout);
  gloo_options->devices.push_back(w.device);
  auto impl = std::make_shared<detail::GroupImpl>();
  impl->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(
      c10::make_intrusive<c10d::PrefixStore>("world", w.store), static_cast<int>(*rank),
      static_cast<int>(*size), gloo_options);
  joining.reset();
  impl->rank = *rank;
  for (int64_t r = 0; r < *size; ++r) impl->global_ranks.push_back(r);
  impl->name = "world";
  impl->timeout = timeout;
  w.store_master = std::make_pair(*addr, static_cast<uint16_t>(*port));
  impl->control_rendezvous = control_rendezvous(w, w.device);
  w.adopted_timeout = timeout;  // a C++ world's groups all wait with its timeout
  w.group = std::move(impl);
  w.init_thread = std::this_thread::get_id();
  w.groups_created = 0;
  trace::detail::start(*rank);
  detail::install_preemption_handler();
}

void init_process_group_from(c10::intrusive_ptr<c10d::ProcessGroup> world_backend,
                             c10::intrusive_ptr<c10d::Store> store, const InitOptions& options) {
  auto& w = world_state();
  std::lock_guard<std::mutex> lock(w.mutex);
  TORCH_CHECK(w.group == nullptr,
              "hyper_parallel::comm::init_process_group_from: already initialised; call "
              "destroy_process_group() first");
  TORCH_CHECK_VALUE(world_backend,
                    "hyper_parallel::comm::init_process_group_from: expected a "
                    "process group, got None");
  TORCH_CHECK_VALUE(store, "hyper_parallel::comm::init_process_group_from: expected a store, got None");
  const int64_t rank = world_backend->getRank(), size = world_backend->getSize();
  // Keys of this library's sub-groups live under a prefix of their own in the shared store.
  w.store = c10::make_intrusive<c10d::PrefixStore>("hyper_parallel", std::move(store));
  auto iface = options.interface() ? options.interface() : env("HP_SOCKET_IFNAME");
  auto master = env("MASTER_ADDR");
  if (iface) {
    w.device = c10d::ProcessGroupGloo::createDeviceForInterface(*iface);
  } else if (master) {
    w.device = c10d::ProcessGroupGloo::createDeviceForHostname(
        local_address_towards(*master, int_from_env({"MASTER_PORT"}, kInit).value_or(0)));
  } else {
    w.device = c10d::ProcessGroupGloo::createDefaultDevice();
  }
  w.store_master = tcp_master(w.store);
  auto impl = std::make_shared<detail::GroupImpl>();
  impl->control_rendezvous = control_rendezvous(w, own_device(world_backend, w.device));
  impl->backend = std::move(world_backend);
  impl->rank = rank;
  for (int64_t r = 0; r < size; ++r) impl->global_ranks.push_back(r);
  impl->name = "world";
  // Without a timeout of ours, transfers wait as long as the front end's own collectives do.
  w.adopted_timeout = timeout_set(options, "init_process_group_from");
  impl->timeout = w.adopted_timeout.value_or(own_timeout(impl->backend, kDefaultTimeout));
  w.adopted.clear();
  w.adopted[impl->backend.get()] = impl;
  w.group = std::move(impl);
  w.init_thread = std::this_thread::get_id();
  w.groups_created = 0;
  trace::detail::start(rank);
  detail::install_stop_report(rank);
  detail::install_preemption_handler();
}

bool is_initialized() { return world_state().group != nullptr; }

Group world() {
  require_world("world");
  return Group(world_state().group);
}

int64_t global_rank() { return require_world("global_rank").rank; }
int64_t world_size() { return static_cast<int64_t>(require_world("world_size").global_ranks.size()); }

void destroy_process_group() {
  trace::flush();
  auto& w = world_state();
  std::vector<std::shared_ptr<detail::GroupImpl>> adopted;
  std::thread::id init_thread;
  {
    std::lock_guard<std::mutex> lock(w.mutex);
    init_thread = w.init_thread;
    w.group.reset();
    w.device.reset();
    w.store.reset();
    w.groups_created = 0;
    for (auto& entry : w.adopted) adopted.push_back(std::move(entry.second));
    w.adopted.clear();
    w.adopted_timeout.reset();
    w.store_master.reset();
  }
  // Outside the lock (and, from Python, without Python's lock): a group's destructor joins its
  // threads, whose callbacks may need either. On the releaser's thread: the caller may be one of
  // them (a callback of torch's work on that group). The thread that made the world waits, so
  // that the groups are gone when this returns; another (such a callback) cannot.
  auto released = release_on_own_thread(std::move(adopted));
  if (std::this_thread::get_id() == init_thread) released.wait();
}

Group adopt_group(c10::intrusive_ptr<c10d::ProcessGroup> backend, std::vector<int64_t> global_ranks,
                  const std::string& name) {
  auto& world_impl = require_world("adopt_group");
  TORCH_CHECK_VALUE(backend, "hyper_parallel::comm::adopt_group: expected a process group, got None");
  auto& w = world_state();
  std::unique_lock<std::mutex> lock(w.mutex);
  if (auto it = w.adopted.find(backend.get()); it != w.adopted.end()) return Group(it->second);
  TORCH_CHECK_VALUE(static_cast<int64_t>(global_ranks.size()) == backend->getSize(),
                    "hyper_parallel::comm::adopt_group: expected one global rank per member of the group (",
                    backend->getSize(), "), got ", global_ranks.size());
  TORCH_CHECK_VALUE(backend->getRank() >= 0 && global_ranks[backend->getRank()] == world_impl.rank,
                    "hyper_parallel::comm::adopt_group: expected this rank (global ", world_impl.rank,
                    ") at its group rank ", backend->getRank(), " of ", c10::IntArrayRef(global_ranks));
  // A group that neither its front end (torch.distributed.destroy_process_group) nor any handle
  // holds any more cannot be passed again: its threads and connections are released.
  std::vector<std::shared_ptr<detail::GroupImpl>> released;
  for (auto it = w.adopted.begin(); it != w.adopted.end();) {
    if (it->second.use_count() == 1 && it->second->backend.use_count() == 1) {
      released.push_back(std::move(it->second));
      it = w.adopted.erase(it);
    } else {
      ++it;
    }
  }
  auto impl = std::make_shared<detail::GroupImpl>();
  impl->rank = backend->getRank();
  impl->global_ranks = std::move(global_ranks);
  std::ostringstream full_name;
  full_name << name << c10::IntArrayRef(impl->global_ranks);
  impl->name = full_name.str();
  impl->timeout = w.adopted_timeout.value_or(own_timeout(backend, world_impl.timeout));
  impl->control_rendezvous = control_rendezvous(w, own_device(backend, w.device));
  impl->backend = std::move(backend);
  w.adopted[impl->backend.get()] = impl;
  lock.unlock();
  release_on_own_thread(std::move(released));
  return Group(std::move(impl));
}

c10::intrusive_ptr<c10d::ProcessGroup> backend_of(const Group& group) { return group.impl().backend; }

Group new_group(const std::vector<int64_t>& ranks) {
  auto& world_impl = require_world("new_group");
  auto& w = world_state();
  const int64_t size = static_cast<int64_t>(world_impl.global_ranks.size());
  TORCH_CHECK(!ranks.empty(), "hyper_parallel::comm::new_group: expected at least one rank, got none");
  for (size_t i = 0; i < ranks.size(); ++i) {
    TORCH_CHECK(ranks[i] >= 0 && ranks[i] < size, "hyper_parallel::comm::new_group: expected ranks[", i,
                "] in [0, ", size, "), got ", ranks[i]);
    TORCH_CHECK(std::count(ranks.begin(), ranks.end(), ranks[i]) == 1,
                "hyper_parallel::comm::new_group: expected distinct ranks, got ", c10::IntArrayRef(ranks));
  }
  std::lock_guard<std::mutex> lock(w.mutex);
  const int64_t id = ++w.groups_created;
  std::ostringstream name;
  name << "group" << id << c10::IntArrayRef(ranks);
  auto it = std::find(ranks.begin(), ranks.end(), world_impl.rank);
  if (it == ranks.end()) return Group();

  auto impl = std::make_shared<detail::GroupImpl>();
  impl->rank = it - ranks.begin();
  impl->global_ranks = ranks;
  impl->name = name.str();
  impl->timeout = world_impl.timeout;
  impl->control_rendezvous = control_rendezvous(w, w.device);
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(world_impl.timeout);
  gloo_options->devices.push_back(w.device);
  impl->backend = c10::make_intrusive<c10d::ProcessGroupGloo>(
      c10::make_intrusive<c10d::PrefixStore>(impl->name, w.store), static_cast<int>(impl->rank),
      static_cast<int>(ranks.size()), gloo_options);
  return Group(std::move(impl));
}

}  // namespace hyper_parallel::comm
