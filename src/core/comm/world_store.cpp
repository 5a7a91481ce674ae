#include "world_store.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include <c10/util/Exception.h>

namespace hyper_parallel::comm::detail {
namespace {

// Waits (polling every 10 ms, at most `limit`) until the store's master accepts connections. A
// TCPStore client that arrives before its master is listening retries only after a second, which
// was most of a restarted job's rendezvous; after `limit` the TCPStore reports the failure itself.
void wait_until_listening(const std::string& host, int64_t port, std::chrono::milliseconds limit) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (bool connected = false; !connected && std::chrono::steady_clock::now() < deadline;) {
    for (addrinfo* a = res; a != nullptr && !connected; a = a->ai_next) {
      const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      connected = fd >= 0 && connect(fd, a->ai_addr, a->ai_addrlen) == 0;
      if (fd >= 0) close(fd);
    }
    if (!connected) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  freeaddrinfo(res);
}

}  // namespace

// The local address whose route reaches `host` (no packet is sent: UDP connect only picks the
// route). Binding Gloo there makes multi-node runs work without naming an interface.
std::string local_address_towards(const std::string& host, int64_t port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  TORCH_CHECK(rc == 0, "hyper_parallel::comm::init_process_group: cannot resolve MASTER_ADDR '", host,
              "': ", gai_strerror(rc));
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  std::string result = "127.0.0.1";
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      char buf[INET_ADDRSTRLEN];
      if (inet_ntop(AF_INET, &local.sin_addr, buf, sizeof(buf)) != nullptr) result = buf;
    }
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  return result;
}

// Rank 0 serves the world's store; the others join it once it listens. A failure names the
// store: torch's own message ("Connection reset by peer", when another program listens on the
// port) does not.
c10::intrusive_ptr<c10d::TCPStore> world_store(const std::string& addr, uint16_t port, int64_t rank,
                                               int64_t size, std::chrono::milliseconds timeout) {
  if (rank != 0) wait_until_listening(addr, port, timeout);
  c10d::TCPStoreOptions store_options;
  store_options.port = port;
  store_options.isServer = rank == 0;
  store_options.numWorkers = static_cast<size_t>(size);
  store_options.timeout = timeout;
  std::string failure;
  try {
    return c10::make_intrusive<c10d::TCPStore>(addr, store_options);
  } catch (const c10::Error& e) {
    failure = e.what_without_backtrace();
  } catch (const std::exception& e) {
    failure = e.what();
  }
  const bool reset = failure.find("reset by peer") != std::string::npos;
  TORCH_CHECK(false, "hyper_parallel::comm::init_process_group: expected rank ", rank,
              rank == 0 ? " to serve the store at " : " to join rank 0's store at ", addr, ":", port,
              ", got a failure: ", failure,
              rank != 0 && reset ? " (a reset there means another program listens on that port)" : "");
}

}  // namespace hyper_parallel::comm::detail
