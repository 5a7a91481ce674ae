#pragma once
// The rendezvous port.

#include <string>

namespace hp_run {

/// A free port on `address`, held while this object lives. The kernel picks it (bind to port 0)
/// and the socket stays bound, with SO_REUSEADDR and not listening: rank 0's store binds the same
/// port beside it (it sets SO_REUSEADDR too), while the kernel hands the port to no one else as an
/// ephemeral port. A port picked and released at once could meanwhile become another program's
/// listener (on a busy node, e.g. a Gloo connection of a concurrent job); the other ranks would
/// then join that listener, and torch's store client aborts their process when it resets them.
/// Lets concurrent single-node jobs (ctest -j) run side by side. Throws std::runtime_error naming
/// the address.
class PortReservation {
 public:
  explicit PortReservation(const std::string& address);
  ~PortReservation();
  PortReservation(const PortReservation&) = delete;
  PortReservation& operator=(const PortReservation&) = delete;

  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

}  // namespace hp_run
