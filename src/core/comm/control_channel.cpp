#include "control_channel.h"

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "flight_recorder.h"
#include "group_impl.h"
#include "tags.h"
#include "test_hooks.h"
#include "transfer.h"

namespace hyper_parallel::comm::detail {
namespace {

// Rank 0 of the group draws a name for the channel's connections and sends it to the others over
// the group's own connections, in the group's op order: no other group, and no earlier channel
// of a group with the same name and ranks, can meet these connections in the store.
std::string draw_channel_name(const Group& group) {
  auto name = at::empty({1}, at::kLong);
  if (group.rank() == 0) {
    auto drawn = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
                 (static_cast<uint64_t>(getpid()) << 40) ^ reinterpret_cast<uintptr_t>(&group.impl());
    try {
      std::random_device device;
      drawn ^= (static_cast<uint64_t>(device()) << 32) ^ device();
    } catch (const std::exception&) {
      // No entropy source: the clock, the process and the group's address still differ.
    }
    name.fill_(static_cast<int64_t>(drawn));
    std::vector<Work> sends;
    for (int64_t q = 1; q < group.size(); ++q) {
      sends.push_back(post_transfer(/*is_send=*/true, name, q, group, kControlTag, /*traceable=*/false));
    }
    for (auto& w : sends) w.wait();
  } else {
    post_transfer(/*is_send=*/false, name, 0, group, kControlTag, /*traceable=*/false).wait();
  }
  std::ostringstream s;
  s << "hyper_parallel_control/" << std::hex << name.item<int64_t>();
  return s.str();
}

// The store of one rendezvous: a client of the world store's master of its own, closed (its
// sockets and its thread) once the backend that keeps this store is made.
class RendezvousStore final : public c10d::Store {
 public:
  explicit RendezvousStore(c10::intrusive_ptr<c10d::Store> client) : client_(std::move(client)) {}
  void close() { client_.reset(); }

  void set(const std::string& key, const std::vector<uint8_t>& value) override { client().set(key, value); }
  std::vector<uint8_t> get(const std::string& key) override { return client().get(key); }
  int64_t add(const std::string& key, int64_t value) override { return client().add(key, value); }
  bool deleteKey(const std::string& key) override { return client().deleteKey(key); }
  bool check(const std::vector<std::string>& keys) override { return client().check(keys); }
  int64_t getNumKeys() override { return client().getNumKeys(); }
  void wait(const std::vector<std::string>& keys) override { client().wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    client().wait(keys, timeout);
  }

 private:
  c10d::Store& client() {
    TORCH_INTERNAL_ASSERT(client_, "RendezvousStore: used after its rendezvous");
    return *client_;
  }
  c10::intrusive_ptr<c10d::Store> client_;
};

// A Gloo backend of the group's ranks that meets under `name`, through a store client of its own:
// a client's waits hold its lock, so no other thread's rendezvous can hold this one up.
c10::intrusive_ptr<c10d::ProcessGroup> connect(const Group& group, const ControlRendezvous& at,
                                               const std::string& name) {
  auto& recorder = FlightRecorder::get();
  recorder.set_waiting(-1, "every rank of " + group.name() + " and the store's master (control channel)");
  c10d::TCPStoreOptions store_options;
  store_options.port = at.port;
  store_options.waitWorkers = false;
  store_options.timeout = group.timeout();
  c10::intrusive_ptr<RendezvousStore> store;
  c10::intrusive_ptr<c10d::ProcessGroup> backend;
  try {
    store = c10::make_intrusive<RendezvousStore>(c10::make_intrusive<c10d::TCPStore>(at.host, store_options));
    auto options = c10d::ProcessGroupGloo::Options::create(group.timeout());
    options->devices.push_back(at.device);
    options->threads = 1;  // its sends and receives need none; its collectives are never used
    backend = c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>(name, store),
                                                          static_cast<int>(group.rank()),
                                                          static_cast<int>(group.size()), options);
  } catch (...) {
    if (store) store->close();
    recorder.clear_waiting();
    throw;
  }
  store->close();
  recorder.clear_waiting();
  return backend;
}

// The channel's connections, made by the group's first op that uses them (collective: every rank
// of the group reaches it at the same op of the group's order). A failure to make them stays the
// group's: every later use reports it, instead of posting where the peers do not listen.
const c10::intrusive_ptr<c10d::ProcessGroup>& control_backend(const Group& group) {
  auto& g = group.impl();
  if (g.control) return g.control;
  // No channel where there is no TCPStore; none made for a compute-only twin, which posts nothing.
  if (!g.control_rendezvous || test_hooks::transfers_skipped()) return g.backend;
  TORCH_CHECK(g.control_failure.empty(), "hyper_parallel::comm: expected the control channel of ",
              group.name(), ", got none: it failed to connect earlier (", g.control_failure, ")");
  try {
    g.control = connect(group, *g.control_rendezvous, draw_channel_name(group));
  } catch (const c10::Error& e) {
    g.control_failure = e.what_without_backtrace();
  } catch (const std::exception& e) {
    g.control_failure = e.what();
  }
  TORCH_CHECK(g.control, "hyper_parallel::comm: expected every rank of ", group.name(),
              " to connect its control channel (through the store's master, within the group's timeout of ",
              g.timeout.count(), " ms), got a failure: ", g.control_failure);
  return g.control;
}

}  // namespace

Work post_control(bool is_send, const at::Tensor& tensor, int64_t peer, const Group& group) {
  return post_transfer(is_send, tensor, peer, group, kControlTag, /*traceable=*/false,
                       control_backend(group));
}

Work post_express(bool is_send, const at::Tensor& tensor, int64_t peer, const Group& group, int tag) {
  TORCH_INTERNAL_ASSERT(tensor.is_contiguous() && peer >= 0 && peer < group.size() && peer != group.rank(),
                        "post_express: expected a contiguous tensor and another rank of ", group.name(),
                        ", got peer ", peer);
  return post_payload(is_send, tensor, peer, group, tag, control_backend(group));
}

}  // namespace hyper_parallel::comm::detail
