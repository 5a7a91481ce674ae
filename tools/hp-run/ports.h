#pragma once
// The rendezvous port.

#include <string>

namespace hp_run {

/// Asks the kernel for a free port by binding port 0 on `address`. The socket is closed again,
/// so there is a small window in which someone else could take the port, but unlike a fixed
/// default it lets concurrent single-node jobs (ctest -j) run side by side. Throws
/// std::runtime_error naming the address.
int pick_free_port(const std::string& address);

}  // namespace hp_run
