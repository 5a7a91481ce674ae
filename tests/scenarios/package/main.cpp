// Uses the installed headers and library: shard arithmetic and a placement, no process group.
#include <iostream>

#include <hyper_parallel/core/comm.h>
#include <hyper_parallel/core/dtensor.h>

int main() {
  namespace hp = hyper_parallel;
  const auto sizes = hp::comm::chunk_sizes(5, 4);
  const bool ok = sizes == std::vector<int64_t>{2, 2, 1, 0} &&
                  hp::dtensor::Shard(-1).normalized(3) == hp::dtensor::Shard(2) &&
                  !hp::comm::is_initialized();
  std::cout << "consumer: " << (ok ? "ok" : "FAILED") << "\n";
  return ok ? 0 : 1;
}
