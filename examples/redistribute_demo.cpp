// A first look at the substrate: a 2-d tensor sharded over the ranks, moved between placements.
//   hp-run --nproc-per-node 2 -- build/examples/redistribute_demo
#include <iostream>

#include <ATen/ATen.h>

#include <hyper_parallel/core/comm.h>
#include <hyper_parallel/core/dtensor.h>

#include "common/run_main.h"

namespace hp = hyper_parallel;
using hp::dtensor::Partial;
using hp::dtensor::Replicate;
using hp::dtensor::Shard;

int main() {
  return hp_examples::run_main("redistribute_demo", [] {
    hp::comm::init_process_group();
    auto mesh = hp::dtensor::init_device_mesh("cpu", {hp::comm::world_size()}, {"tp"});
    const auto rank = hp::comm::global_rank();

    auto full = at::arange(24, at::kFloat).reshape({6, 4});
    auto rows = hp::dtensor::distribute_tensor(full, mesh, {Shard(0)});
    std::cout << "Shard(0) local:\n" << rows.to_local() << "\n";

    auto cols = rows.redistribute({Shard(1)});  // all_to_all
    std::cout << "Shard(1) local:\n" << cols.to_local() << "\n";

    auto partial = hp::dtensor::DTensor::from_local(at::full({2, 2}, double(rank + 1)), mesh, {Partial()});
    std::cout << "Partial -> Replicate (sum over ranks of rank+1):\n"
              << partial.redistribute({Replicate()}).to_local() << "\n";

    const bool same = cols.full_tensor().equal(full);
    std::cout << "round trip equals the original: " << (same ? "yes" : "NO") << "\n";
    std::cout << "collectives: " << hp::comm::collective_counts_summary() << "\n";
    hp::comm::destroy_process_group();
    return same ? 0 : 1;
  });
}
