#pragma once
// Internal: a GradientReducer's first bucket layout. Which parameters it averages (defined,
// leaf, floating point, requiring grad, each once), which of them are reduced row-sparse, the
// layout in reverse order, and the ranks' agreement on it (and on the options that shape a
// rebuilt one), compared once at construction so that the buckets later start without a round
// trip each.

#include <vector>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/data_parallel/gradient_reducer.h>

#include "bucket_layout.h"

namespace hyper_parallel::data_parallel::detail {

struct FirstLayout {
  std::vector<at::Tensor> params;  // the parameters kept, in their order
  BucketCaps caps;
  std::vector<BucketSpan> spans;
};

/// Collective over `group`: every rank calls it, in the same order. Throws (on every rank) where
/// the ranks' layouts or layout options differ.
FirstLayout agree_on_first_layout(const std::vector<at::Tensor>& params,
                                  const GradientReducerOptions& options, const comm::Group& group);

}  // namespace hyper_parallel::data_parallel::detail
