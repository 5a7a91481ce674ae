// A job in which rank 2 gets stuck before its second collective, for stuck_rank.sh:
//   stuck_rank_main sleep   rank 2 sleeps in its own code (it dies on SIGTERM)
//   stuck_rank_main stop    rank 2 stops itself with SIGSTOP (it ignores SIGTERM)
// The other ranks time out (HP_TIMEOUT_S), print their flight recorder and exit 1.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm.h>

namespace hp = hyper_parallel;

int main(int argc, char** argv) {
  const bool stop = argc > 1 && std::strcmp(argv[1], "stop") == 0;
  try {
    hp::comm::init_process_group();
    auto world = hp::comm::world();
    hp::comm::all_reduce(at::ones({4}), hp::comm::ReduceOp::kSum, world);
    if (world.rank() == 2) {
      if (stop) {
        ::raise(SIGSTOP);
      } else {
        ::sleep(120);
      }
    }
    hp::comm::all_gather(at::ones({1 << 16}), 0, world);
    hp::comm::destroy_process_group();
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    std::fprintf(stderr, "stuck_rank_main: %s\n", message.substr(0, message.find('\n')).c_str());
    return 1;
  }
  return 0;
}
