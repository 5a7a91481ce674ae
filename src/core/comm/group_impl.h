#pragma once
// Internal: what a Group is made of.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <hyper_parallel/core/comm/link_probe.h>
#include <hyper_parallel/core/comm/process_group.h>

#include "worker_thread.h"

namespace gloo::transport {
class Device;
}  // namespace gloo::transport

namespace hyper_parallel::comm::detail {

/// Where a group's control channel meets: the world store's master, which the channel reaches
/// with a store client of its own (a client's waits hold its lock, so a channel never waits on
/// another thread's rendezvous), and the transport device.
struct ControlRendezvous {
  std::string host;
  uint16_t port = 0;
  std::shared_ptr<::gloo::transport::Device> device;
};

struct GroupImpl {
  c10::intrusive_ptr<c10d::ProcessGroup> backend;
  std::vector<int64_t> global_ranks;
  int64_t rank = 0;  // inside the group
  std::string name;
  std::chrono::milliseconds timeout{0};
  std::atomic<int64_t> next_op{0};                // tag blocks handed out so far
  std::atomic<int64_t> next_seq{0};               // ops (OpScope) started on this group so far
  std::atomic<std::thread::id> issuing_thread{};  // the thread inside an OpScope on it, if any
  std::mutex link_mutex;                          // guards link (not held while probing)
  std::optional<LinkEstimate> link;               // link_probe.h, once measured
  // The control channel (control_channel.h): where its connections meet, set when the group is
  // made (none: a world whose store is not a TCPStore, and the channel is the group's own
  // connections); the connections, made by the group's first op that uses the channel; the
  // failure to make them, if that failed. Only the issuing thread touches the last two.
  std::optional<ControlRendezvous> control_rendezvous;
  c10::intrusive_ptr<c10d::ProcessGroup> control;
  std::string control_failure;
  // The ops agreed in advance since the last per-op agreement (op.h): their count, the call
  // number of the first, and a digest of their signatures. Only the issuing thread touches them.
  int64_t unagreed_ops = 0, unagreed_first_seq = -1;
  uint64_t unagreed_digest = 0;
  // Completes this group's asynchronous collectives in the order they were started (a
  // PendingAllReduce's second phase: wait for the partials, sum, send the result). One per group,
  // so that a small all-reduce on one group (a tensor-parallel gradient sum) never queues behind a
  // large one on another (a data-parallel bucket) still waiting for its partials; it ends with the
  // group. It posts transfers only for ops the issuing thread has started (and reserved tags
  // for), so the one-thread-per-group rule of op.h holds. Gloo's send and receive works do not
  // report completion until waited for, so polling cannot replace it.
  WorkerThread completion_thread;
};

}  // namespace hyper_parallel::comm::detail
