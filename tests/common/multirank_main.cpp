// main() of every multi-rank test binary: joins the process group launched by hp-run, runs the
// tests (every rank runs every test, in the same order), then leaves together.
#include <gtest/gtest.h>

#include <iostream>

#include <hyper_parallel/core/comm.h>

namespace {

// Ranks other than 0 print their failures only (hp-run prefixes each line with the rank).
class FailurePrinter : public ::testing::EmptyTestEventListener {
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    // (gtest holds its lock here: no UnitTest queries.)
    std::cerr << (result.file_name() ? result.file_name() : "?") << ":" << result.line_number()
              << ": Failure\n"
              << result.message() << "\n";
  }
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  hyper_parallel::comm::init_process_group();
  // Only rank 0 prints the per-test progress; every rank prints its failures.
  if (hyper_parallel::comm::global_rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter);
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
