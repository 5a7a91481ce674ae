// Errors a user can cause around process groups, in one process (no launcher), and what a world of
// one decides for the groups it adopts.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <hyper_parallel/core/comm.h>
#include <hyper_parallel/core/dtensor.h>

#include "common/test_util.h"

namespace hp = hyper_parallel;

namespace {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    value ? setenv(name, value, 1) : unsetenv(name);
  }
  ~ScopedEnv() { old_ ? setenv(name_, old_->c_str(), 1) : unsetenv(name_); }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(ProcessGroupErrors, UseBeforeInitNamesTheFix) {
  ASSERT_FALSE(hp::comm::is_initialized());
  HP_EXPECT_THROW_MSG(hp::comm::world(), "process group is not initialised; call init_process_group()");
  HP_EXPECT_THROW_MSG(hp::comm::new_group({0}), "new_group: process group is not initialised");
  HP_EXPECT_THROW_MSG(hp::dtensor::init_device_mesh("cpu", {1}),
                      "init_device_mesh: process group is not initialised; call init_process_group()");
}

TEST(ProcessGroupErrors, MissingOrBadEnvironment) {
  ScopedEnv no_rank("RANK", nullptr), no_ompi("OMPI_COMM_WORLD_RANK", nullptr),
      no_slurm("SLURM_PROCID", nullptr);
  HP_EXPECT_THROW_MSG(hp::comm::init_process_group(), "expected the rank in RANK");
  {
    ScopedEnv rank("RANK", "0"), size("WORLD_SIZE", nullptr), o("OMPI_COMM_WORLD_SIZE", nullptr),
        s("SLURM_NTASKS", nullptr);
    HP_EXPECT_THROW_MSG(hp::comm::init_process_group(), "expected the world size in WORLD_SIZE");
  }
  {
    ScopedEnv rank("RANK", "x1"), size("WORLD_SIZE", "1");
    HP_EXPECT_THROW_MSG(hp::comm::init_process_group(), "expected an integer for RANK, got 'x1'");
  }
  {
    ScopedEnv rank("RANK", "2"), size("WORLD_SIZE", "2");
    HP_EXPECT_THROW_MSG(hp::comm::init_process_group(), "expected rank in [0, 2), got 2");
  }
  {
    ScopedEnv rank("RANK", "0"), size("WORLD_SIZE", "1"), addr("MASTER_ADDR", nullptr);
    HP_EXPECT_THROW_MSG(hp::comm::init_process_group(), "expected MASTER_ADDR to be set");
  }
  {
    ScopedEnv rank("RANK", "0"), size("WORLD_SIZE", "1"), addr("MASTER_ADDR", "127.0.0.1"),
        port("MASTER_PORT", "70000");
    HP_EXPECT_THROW_MSG(hp::comm::init_process_group(), "expected MASTER_PORT in [1, 65535], got 70000");
  }
  {
    ScopedEnv rank("RANK", "0"), size("WORLD_SIZE", "1"), addr("MASTER_ADDR", "127.0.0.1"),
        port("MASTER_PORT", "29500");
    HP_EXPECT_THROW_MSG(
        hp::comm::init_process_group(hp::comm::InitOptions().timeout(std::chrono::seconds(0))),
        "init_process_group: expected a timeout > 0, got 0 ms");
    ScopedEnv timeout("HP_TIMEOUT_S", "0");
    HP_EXPECT_THROW_MSG(hp::comm::init_process_group(), "expected HP_TIMEOUT_S > 0, got 0");
  }
  {
    // Launchers other than hp-run: mpirun's variables are read when RANK is absent.
    ScopedEnv ompi("OMPI_COMM_WORLD_RANK", "3"), size("WORLD_SIZE", "2");
    HP_EXPECT_THROW_MSG(hp::comm::init_process_group(), "expected rank in [0, 2), got 3");
  }
  EXPECT_FALSE(hp::comm::is_initialized());
}

TEST(ProcessGroupErrors, SingleProcessWorldFromOptions) {
  // A world of one needs no launcher: rendezvous with itself on a free port.
  hp::comm::init_process_group(hp::comm::InitOptions()
                                   .rank(0)
                                   .world_size(1)
                                   .master_addr("127.0.0.1")
                                   .master_port(0 + 29000 + (getpid() % 1000))
                                   .timeout(std::chrono::seconds(20)));
  auto world = hp::comm::world();
  EXPECT_EQ(world.size(), 1);
  EXPECT_EQ(world.rank(), 0);
  auto x = at::arange(6, at::kFloat).reshape({2, 3});
  EXPECT_TRUE(hp::comm::all_gather(x, 1, world).equal(x));
  EXPECT_TRUE(hp::comm::all_reduce(x, hp::comm::ReduceOp::kSum, world).equal(x));
  HP_EXPECT_THROW_MSG(hp::dtensor::init_device_mesh("cpu", {2}),
                      "init_device_mesh: expected mesh_shape [2] to hold the world size 1, got 2");
  HP_EXPECT_THROW_MSG(hp::dtensor::init_device_mesh("cuda", {1}), "device_type 'cuda' is not supported");
  hp::comm::destroy_process_group();
  EXPECT_FALSE(hp::comm::is_initialized());
}

// A listening socket of another program on 127.0.0.1: it accepts connections, and resets the first
// one that sends it something (what a foreign listener does with a store client's request).
class ForeignListener {
 public:
  ForeignListener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), len), 0);
    EXPECT_EQ(::listen(fd_, 8), 0);
    EXPECT_EQ(::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len), 0);
    port_ = ntohs(addr.sin_port);
  }
  ~ForeignListener() { ::close(fd_); }
  int port() const { return port_; }
  // Accepts until a connection sends a byte, then resets that one.
  std::thread reset_the_first_talker() const {
    return std::thread([fd = fd_] {
      for (;;) {
        const int conn = ::accept(fd, nullptr, nullptr);
        if (conn < 0) return;
        char byte;
        if (::recv(conn, &byte, 1, 0) == 1) {
          const linger reset{1, 0};
          ::setsockopt(conn, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
          ::close(conn);
          return;
        }
        ::close(conn);  // wait_until_listening's probe, which sends nothing
      }
    });
  }

 private:
  int fd_ = -1;
  int port_ = 0;
};

TEST(ProcessGroupErrors, AStoreThatIsNotThereIsNamed) {
  const ForeignListener foreign;
  const auto options = [&](int64_t rank) {
    return hp::comm::InitOptions()
        .rank(rank)
        .world_size(2)
        .master_addr("127.0.0.1")
        .master_port(foreign.port())
        .timeout(std::chrono::seconds(20));
  };
  // Rank 0 cannot serve where another program listens.
  HP_EXPECT_THROW_MSG(hp::comm::init_process_group(options(0)),
                      "init_process_group: expected rank 0 to serve the store at 127.0.0.1:" +
                          std::to_string(foreign.port()) + ", got a failure: ");
  // Another rank that joins it is reset, and told why (torch says "Connection reset by peer" only).
  std::thread resetter = foreign.reset_the_first_talker();
  HP_EXPECT_THROW_MSG(hp::comm::init_process_group(options(1)),
                      "init_process_group: expected rank 1 to join rank 0's store at 127.0.0.1:" +
                          std::to_string(foreign.port()) +
                          ", got a failure: Connection reset by peer (a reset there means another program "
                          "listens on that port)");
  resetter.join();
  EXPECT_FALSE(hp::comm::is_initialized());
}

TEST(ProcessGroupErrors, AGroupAdoptedByACppWorldWaitsWithTheWorldsTimeout) {
  hp::comm::init_process_group(hp::comm::InitOptions()
                                   .rank(0)
                                   .world_size(1)
                                   .master_addr("127.0.0.1")
                                   .master_port(0 + 29000 + (getpid() + 500) % 1000)
                                   .timeout(std::chrono::seconds(20)));
  // A Gloo backend made elsewhere, with a timeout of its own.
  auto options = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(3));
  options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  auto backend =
      c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::HashStore>(), 0, 1, options);
  auto group = hp::comm::adopt_group(backend, {0}, "other");
  EXPECT_EQ(group.timeout(), std::chrono::milliseconds(20000));
  auto x = at::arange(4, at::kFloat);
  EXPECT_TRUE(hp::comm::all_reduce(x, hp::comm::ReduceOp::kSum, group).equal(x));
  hp::comm::destroy_process_group();
}

}  // namespace
