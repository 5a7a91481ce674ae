// Trains Llama 3 with tensor parallelism (+ sequence parallelism) on synthetic data.
//   hp-run --nproc-per-node 2 -- build/examples/torch/llama3/llama3_train --steps 20
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <hyper_parallel/core/comm.h>

#include "common/run_main.h"
#include "trainer.h"

namespace {

void usage() {
  std::fprintf(stderr,
               "usage: llama3_train [--preset debug|tiny|bench|llama3_8b_1layer] [--steps N] [--batch-size N]\n"
               "                    [--seq-len N] [--dtype fp32|bf16] [--lr X] [--seed N]\n"
               "                    [--no-sequence-parallel] [--loss-parallel]\n"
               "                    [--enable-mc2 [--mc2-chunks N] [--relaxed-mc2-contract]]\n");
}

}  // namespace

int main(int argc, char** argv) {
  llama3::TrainOptions options;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "llama3_train: %s expects a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    try {
      if (a == "--preset") options.preset(value());
      else if (a == "--steps") options.steps(std::stoll(value()));
      else if (a == "--batch-size") options.batch_size(std::stoll(value()));
      else if (a == "--seq-len") options.seq_len(std::stoll(value()));
      else if (a == "--dtype") options.dtype(value());
      else if (a == "--lr") options.lr(std::stod(value()));
      else if (a == "--seed") options.seed(std::stoull(value()));
      else if (a == "--no-sequence-parallel") options.enable_sequence_parallel(false);
      else if (a == "--loss-parallel") options.enable_loss_parallel(true);
      else if (a == "--enable-mc2") options.enable_mc2(true);
      else if (a == "--relaxed-mc2-contract") options.relaxed_mc2_contract(true);
      else if (a == "--mc2-chunks") options.mc2_chunks_per_rank(std::stoll(value()));
      else if (a == "-h" || a == "--help") { usage(); return 0; }
      else {
        std::fprintf(stderr, "llama3_train: unknown flag '%s'\n", a.c_str());
        usage();
        return 2;
      }
    } catch (const std::logic_error&) {
      std::fprintf(stderr, "llama3_train: %s: expected a number, got '%s'\n", a.c_str(), argv[i]);
      return 2;
    }
  }
  return hp_examples::run_main("llama3_train", [&] {
  hyper_parallel::comm::init_process_group();
  auto results = llama3::train(options);
  const bool fell = results.size() < 2 || results.back().loss < results.front().loss;
  if (hyper_parallel::comm::global_rank() == 0) {
    std::printf("loss %s: %.4f -> %.4f\n", fell ? "fell" : "did NOT fall", results.front().loss,
                results.back().loss);
  }
  hyper_parallel::comm::destroy_process_group();
  return fell ? 0 : 1;
  });
}
