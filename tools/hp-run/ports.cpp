#include "ports.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <stdexcept>
#include <string>

#include "io.h"

namespace hp_run {
namespace {

// A socket bound to `port` on every local address with SO_REUSEADDR, or -1 with errno set: [::]
// dual-stack first (torch's store binds there), else 0.0.0.0 (no IPv6 on this node).
int bind_everywhere(int port) {
  const int reuse = 1, v6_only = 0;
  int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd >= 0) {
    sockaddr_in6 any{};
    any.sin6_family = AF_INET6;
    any.sin6_addr = in6addr_any;
    any.sin6_port = htons(static_cast<uint16_t>(port));
    if (::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6_only, sizeof v6_only) == 0 &&
        ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &reuse, sizeof reuse) == 0 &&
        ::bind(fd, reinterpret_cast<const sockaddr*>(&any), sizeof any) == 0) {
      return fd;
    }
    const int error = errno;
    ::close(fd);
    if (error != EAFNOSUPPORT && error != EADDRNOTAVAIL) {
      errno = error;
      return -1;
    }
  }
  fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in any{};
  any.sin_family = AF_INET;
  any.sin_addr.s_addr = htonl(INADDR_ANY);
  any.sin_port = htons(static_cast<uint16_t>(port));
  if (::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &reuse, sizeof reuse) == 0 &&
      ::bind(fd, reinterpret_cast<const sockaddr*>(&any), sizeof any) == 0) {
    return fd;
  }
  const int error = errno;
  ::close(fd);
  errno = error;
  return -1;
}

// The port a bound socket has.
int bound_port(int fd) {
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length) != 0) return -1;
  const in_port_t port = bound.ss_family == AF_INET6
                             ? reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port
                             : reinterpret_cast<const sockaddr_in*>(&bound)->sin_port;
  return ntohs(port);
}

}  // namespace

PortReservation::PortReservation(int port) {
  fd_ = bind_everywhere(port);
  if (fd_ < 0 && port != 0) {
    throw PortUnavailable("expected port " + std::to_string(port) +
                          " free on this node for rank 0's store, got it held by another socket (" +
                          errno_text(errno) + "; another program listens there?)");
  }
  if (fd_ < 0) throw std::runtime_error("cannot pick a free port on this node: " + errno_text(errno));
  port_ = port != 0 ? port : bound_port(fd_);
  if (port_ <= 0) {
    ::close(fd_);
    throw std::runtime_error("cannot pick a free port on this node: " + errno_text(errno));
  }
}

PortReservation::~PortReservation() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace hp_run
