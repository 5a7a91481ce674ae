#pragma once
// Internal: where init_process_group's ranks meet. Rank 0 serves the world's TCPStore and the
// others join it; Gloo binds to the local address that routes to the store's host.

#include <chrono>
#include <cstdint>
#include <string>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace hyper_parallel::comm::detail {

/// The local address whose route reaches `host` ("127.0.0.1" when none does); a c10::Error
/// naming MASTER_ADDR when `host` does not resolve.
std::string local_address_towards(const std::string& host, int64_t port);

/// The world's store at `addr:port`: served by rank 0, joined by the others once it listens
/// (waiting at most `timeout`). All ranks call once per world. A failure is a c10::Error that
/// names the store and the rank's part in it.
c10::intrusive_ptr<c10d::TCPStore> world_store(const std::string& addr, uint16_t port, int64_t rank,
                                               int64_t size, std::chrono::milliseconds timeout);

}  // namespace hyper_parallel::comm::detail
