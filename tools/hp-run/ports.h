#pragma once
// The rendezvous port.

#include <stdexcept>
#include <string>

namespace hp_run {

/// A port rank 0's store cannot listen on: another socket of this node holds it.
class PortUnavailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The rendezvous port, held on this node (the one of rank 0's store) while this object lives:
/// bound on every local address (dual-stack [::], or 0.0.0.0 without IPv6), as the store binds
/// it, with SO_REUSEADDR and not listening. The store binds the same port beside it (it sets
/// SO_REUSEADDR too), while the kernel hands the port to no one else as an ephemeral port. A port
/// picked and released at once could meanwhile become another program's listener (on a busy
/// node, e.g. a Gloo connection of a concurrent job); the other ranks would then join that
/// listener, and torch's store client aborts their process when it resets them.
///   - port 0: a free port the kernel picks (bind to port 0); std::runtime_error if there is
///     none. Lets concurrent single-node jobs (ctest -j) run side by side.
///   - a given port: PortUnavailable if it cannot be held (another program listens on it, on any
///     local address), before any rank starts.
class PortReservation {
 public:
  explicit PortReservation(int port);
  ~PortReservation();
  PortReservation(const PortReservation&) = delete;
  PortReservation& operator=(const PortReservation&) = delete;

  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

}  // namespace hp_run
