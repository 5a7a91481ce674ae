// Loads a Llama 3 checkpoint (model and AdamW state, saved at any TP degree, by either language)
// into the C++ model at this launch's TP degree, then saves it unchanged to another root at the
// same step: the C++ half of the cross-language checkpoint test. With FSDP (> 0), the model is
// on a {dp = FSDP, tp = N / FSDP} mesh, its blocks and root fully_shard'ed over dp.
//   hp-run --nproc-per-node N -- reshard_main PRESET DTYPE FROM_ROOT TO_ROOT [FSDP]
#include <algorithm>
#include <cstdio>
#include <string>

#include <torch/optim/adamw.h>

#include <hyper_parallel/checkpoint.h>
#include <hyper_parallel/core/comm.h>
#include <hyper_parallel/core/dtensor.h>
#include <hyper_parallel/core/fully_shard.h>

#include "common/run_main.h"
#include "llama3/model.h"
#include "llama3/parallelize.h"

int main(int argc, char** argv) {
  namespace hp = hyper_parallel;
  if (argc != 5 && argc != 6) {
    std::fprintf(stderr, "usage: reshard_main PRESET fp32|bf16 FROM_ROOT TO_ROOT [FSDP]\n");
    return 2;
  }
  const std::string preset = argv[1], dtype = argv[2], from = argv[3], to = argv[4];
  const int64_t fsdp = argc == 6 ? std::stoll(argv[5]) : 0;
  return hp_examples::run_main("reshard_main", [&] {
    hp::comm::init_process_group();
    const int64_t world = hp::comm::world_size();
    auto mesh = fsdp > 0 ? hp::dtensor::init_device_mesh("cpu", {fsdp, world / fsdp}, {"dp", "tp"})
                         : hp::dtensor::init_device_mesh("cpu", {world}, {"tp"});
    llama3::Transformer model(llama3::ModelArgs::from_preset(preset));
    model->to(dtype == "bf16" ? at::kBFloat16 : at::kFloat);
    llama3::parallelize_llama3(*model, fsdp > 0 ? mesh["tp"] : mesh);
    if (fsdp > 0) {
      const auto options = hp::fully_shard::FullyShardOptions().mesh(mesh["dp"]);
      for (const auto& block : *model->layers) hp::fully_shard::fully_shard(*block, options);
      hp::fully_shard::fully_shard(*model, options);
    }
    torch::optim::AdamW optimizer(model->parameters());
    auto state = hp::checkpoint::model_state(*model);
    hp::checkpoint::add_optimizer_state(state, optimizer, *model);
    const auto step = hp::checkpoint::latest_step(from);
    TORCH_CHECK(step.has_value(), "reshard_main: expected a checkpoint in ", from, ", got none");
    hp::checkpoint::load(from, state);
    hp::checkpoint::save(to, state, hp::checkpoint::SaveOptions().step(*step));
    if (hp::comm::global_rank() == 0)
      std::printf("resharded step %lld to FSDP %lld x TP %lld\n", static_cast<long long>(*step),
                  static_cast<long long>(fsdp > 0 ? fsdp : 1),
                  static_cast<long long>(world / std::max<int64_t>(fsdp, 1)));
    hp::comm::destroy_process_group();
    return 0;
  });
}
