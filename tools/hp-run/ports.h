#pragma once
// The rendezvous port.

#include <string>

namespace hp_run {

/// The rendezvous port on `address` (this node's), held while this object lives: bound, with
/// SO_REUSEADDR and not listening. Rank 0's store binds the same port beside it (it sets
/// SO_REUSEADDR too), while the kernel hands the port to no one else as an ephemeral port. A port
/// picked and released at once could meanwhile become another program's listener (on a busy
/// node, e.g. a Gloo connection of a concurrent job); the other ranks would then join that
/// listener, and torch's store client aborts their process when it resets them.
///   - port 0: a free port the kernel picks (bind to port 0). Lets concurrent single-node jobs
///     (ctest -j) run side by side.
///   - a given port: held if it is free; std::runtime_error if another socket of this node holds
///     it (rank 0's store could not listen there). Not held where `address` is not this node's.
/// Throws std::runtime_error naming the address.
class PortReservation {
 public:
  PortReservation(const std::string& address, int port);
  ~PortReservation();
  PortReservation(const PortReservation&) = delete;
  PortReservation& operator=(const PortReservation&) = delete;

  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

}  // namespace hp_run
