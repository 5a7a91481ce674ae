#include "ports.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <stdexcept>
#include <string>

#include "io.h"

namespace hp_run {

namespace {

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

PortReservation::PortReservation(const std::string& address, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(address.c_str(), std::to_string(port).c_str(), &hints, &found);
  if (rc != 0) {
    throw std::runtime_error("cannot resolve --master-addr '" + address + "': " + ::gai_strerror(rc));
  }
  const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(found, &::freeaddrinfo);

  std::string last_error = "no usable address";
  for (const addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last_error = errno_text(errno);
      continue;
    }
    const int reuse = 1;
    if (::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &reuse, sizeof reuse) == 0 &&
        ::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && (port_ = bound_port(fd)) > 0) {
      fd_ = fd;
      return;
    }
    const int error = errno;
    ::close(fd);
    if (port != 0 && error == EADDRINUSE) {
      throw std::runtime_error(
          "--master-port " + std::to_string(port) + " on '" + address +
          "' is in use by another socket of this node (another program listens there?): "
          "rank 0's store could not listen on it; pick another port, or 0 for a free one");
    }
    last_error = errno_text(error);
  }
  if (port != 0) {  // not this node's address (or no socket for it): the port is not held here
    port_ = port;
    return;
  }
  throw std::runtime_error("cannot pick a free port on '" + address + "': " + last_error);
}

PortReservation::~PortReservation() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace hp_run
