// main() of every multi-rank test binary: joins the process group launched by hp-run, runs the
// tests (every rank runs every test, in the same order), then leaves together.
#include <gtest/gtest.h>

#include <hyper_parallel/core/comm.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  hyper_parallel::comm::init_process_group();
  // Only rank 0 prints the per-test progress; every rank prints its failures.
  if (hyper_parallel::comm::global_rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int result = RUN_ALL_TESTS();
  if (result != 0) {
    std::cerr << "rank " << hyper_parallel::comm::global_rank() << ": tests failed\n";
    return result;  // hp-run stops the other ranks
  }
  hyper_parallel::comm::barrier(hyper_parallel::comm::world());
  hyper_parallel::comm::destroy_process_group();
  return 0;
}
