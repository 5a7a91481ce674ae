// Whether a group's shards changed since it read them: since its gather (gathered ahead, then
// written in place: gather again), since the buffers were made (a cast or materialization of
// the module: make them anew), and since a forward (its backward would pair the forward's
// activations with other values: an error).
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "param_group_impl.h"

namespace hyper_parallel::fully_shard {

bool ParamGroup::Impl::shards_changed() const {
  for (size_t i = 0; i < params.size(); ++i) {
    // Replaced data (a .data write, a cast) has a storage of its own, also where this rank's
    // piece is empty, so every rank sees the change.
    const auto& read = read_at_gather[i];
    if (static_cast<int64_t>(params[i]._version()) != versions_at_gather[i] || !params[i].is_alias_of(read) ||
        params[i].storage_offset() != read.storage_offset() || params[i].scalar_type() != read.scalar_type())
      return true;
  }
  return false;
}

bool ParamGroup::Impl::buffers_stale() const {
  if (params.empty()) return false;
  if (!policy_dtype && params[0].scalar_type() != gather_dtype) return true;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].device() != buffers[i].device()) return true;  // a part made on meta, say
  }
  return false;
}

void ParamGroup::Impl::check_not_converted_since(int64_t made) const {
  TORCH_CHECK_VALUE(made == generation && !buffers_stale(), "fully_shard: expected the parameters of ",
                    label(),
                    " to keep the dtype and device their forward read them in until its backward, got ",
                    "them converted to ", params.empty() ? gather_dtype : params[0].scalar_type(), " on ",
                    params.empty() ? at::Device(at::kCPU) : params[0].device(),
                    " in between (module.to between a forward and its backward: run the backward first, or "
                    "convert before the forward)");
}

std::vector<detail::ShardState> ParamGroup::Impl::shard_states() const {
  std::vector<detail::ShardState> states;
  for (const auto& p : params)
    states.push_back({static_cast<int64_t>(p._version()), p.storage().unsafeGetStorageImpl()});
  return states;
}

void ParamGroup::Impl::check_unchanged_since(const std::vector<detail::ShardState>& read) const {
  if (row_sparse_cols > 0) return;
  const auto now = shard_states();
  for (size_t i = 0; i < params.size() && i < read.size(); ++i) {
    TORCH_CHECK_VALUE(now[i].version == read[i].version && now[i].storage == read[i].storage,
                      "fully_shard: expected the parameters of ", label(),
                      " unchanged from a forward to its backward, got ", names[i],
                      " changed in place in between (an optimizer step, load_state_dict or a copy into it "
                      "before the backward): the backward would pair the forward's activations with other "
                      "values; run the backward first");
  }
}

}  // namespace hyper_parallel::fully_shard
