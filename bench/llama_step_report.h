#pragma once
// bench_llama_step's tables: per configuration the step, its bounds and floor, bytes, model state,
// peak RSS and exposed waits; data parallelism's buckets.

#include <string>
#include <vector>

#include "link_cost.h"
#include "llama_step.h"

namespace llama_step {

/// The table of one rate (rank 0 prints it).
void report(const Bench& b, const std::vector<Measured>& results, const std::string& preset,
            const std::string& rate, const bench::LinkCost& link, const Meshes& meshes);
/// Each data-parallel configuration's buckets, in launch order.
void report_buckets(const Bench& b);

}  // namespace llama_step
