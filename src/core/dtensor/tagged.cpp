// DTensor's tags: a local tensor handed out by to_local_tagged, found again by from_tagged and by
// the autograd walk of trace_back; and the recent tagged tensors that shard their last dim.
#include <hyper_parallel/core/dtensor/dtensor.h>

#include <algorithm>
#include <deque>
#include <mutex>
#include <unordered_set>
#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include "../autograd/attach_backward.h"
#include "../util/weak_tensor_map.h"
#include "grad_slot.h"
#include "last_dim.h"

namespace hyper_parallel::dtensor {

namespace {

// Tagged local tensors: what from_tagged makes a DTensor of again.
struct Tag {
  DeviceMesh mesh;
  Placements placements;
  std::vector<int64_t> shape;
  std::shared_ptr<void> slot;
};

hyper_parallel::detail::WeakTensorMap<Tag>& tags() {
  static hyper_parallel::detail::WeakTensorMap<Tag> table;
  return table;
}

// The tensors tagged (by any thread) whose DTensor shards its last dim, newest first, each with its
// layout and held weakly (no mesh is held): every one still alive and the last kGoneShards that are
// gone. What recent_last_dim_shards returns.
struct RecentShard {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> local;
  std::vector<int64_t> shape, mesh_shape;
  Placements placements;
};
constexpr size_t kGoneShards = 8;
std::mutex recent_mutex;
std::deque<RecentShard> recent_shards;  // guarded by recent_mutex

bool shards_last_dim(const Placements& placements, int64_t ndim) {
  return std::any_of(placements.begin(), placements.end(),
                     [&](const Placement& p) { return ndim > 0 && p.is_shard(ndim - 1); });
}

void remember_last_dim_shard(RecentShard shard) {
  std::lock_guard<std::mutex> lock(recent_mutex);
  const auto* impl = shard.local._unsafe_get_target();
  std::deque<RecentShard> kept{std::move(shard)};
  size_t gone = 0;
  for (auto& r : recent_shards) {
    if (r.local._unsafe_get_target() == impl || (r.local.expired() && ++gone > kGoneShards)) continue;
    kept.push_back(std::move(r));
  }
  recent_shards = std::move(kept);
}

}  // namespace

at::Tensor DTensor::to_local_tagged() const {
  tags().insert_or_assign(local_, Tag{mesh_, placements_, shape_, grad_slot_});
  if (shards_last_dim(placements_, dim()))
    remember_last_dim_shard(
        {c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(local_.getIntrusivePtr()), shape_,
         mesh_.shape(), placements_});
  // On its node too: tensors computed from it find it there (trace_back), even once it is gone.
  if (local_.grad_fn())
    detail::annotate_node(*local_.grad_fn(), std::make_shared<Tag>(Tag{mesh_, placements_, shape_, nullptr}));
  return local_;
}

std::optional<DTensor> DTensor::from_tagged(const at::Tensor& local) {
  auto tag = tags().find(local);
  if (!tag) return std::nullopt;
  DTensor result(local, tag->mesh, tag->placements, tag->shape);
  result.grad_slot_ = std::static_pointer_cast<GradSlot>(tag->slot);
  return result;
}

at::Tensor DTensor::carry_tag(const at::Tensor& from, const at::Tensor& to) {
  auto tagged = from.defined() && to.defined() && !from.is_same(to) ? from_tagged(from) : std::nullopt;
  if (!tagged) return to;
  TORCH_CHECK_VALUE(to.sizes() == from.sizes(),
                    "DTensor::carry_tag: expected a tensor of the tagged one's shape ", from.sizes(),
                    ", got ", to.sizes());
  tagged->local_ = to;
  return tagged->to_local_tagged();
}

TaggedTrace DTensor::trace_back(const at::Tensor& t, int64_t max_nodes) {
  TaggedTrace trace;
  if (!t.defined() || !t.grad_fn()) return trace;
  std::unordered_set<const torch::autograd::Node*> seen;
  bool layout_started = false;  // a matmul or an untagged DTensor's node on the way
  std::string other;            // the first such node, or a leaf's (an AccumulateGrad)
  // Breadth first from t's node, each with the first op on its path that may mix the last dim. The
  // walk goes on past the tag to the other branches, whose gradients it would not see.
  std::deque<std::pair<torch::autograd::Node*, std::string>> queue{{t.grad_fn().get(), ""}};
  while (!queue.empty() && static_cast<int64_t>(seen.size()) < max_nodes) {
    auto [node, mixed] = std::move(queue.front());
    queue.pop_front();
    if (!seen.insert(node).second) continue;
    if (auto tag = std::static_pointer_cast<Tag>(detail::node_annotation(*node))) {
      if (!trace.tagged) {
        trace.mixed_by = mixed;
        auto local =
            at::empty(local_shape(tag->shape, tag->mesh.shape(), tag->mesh.coordinate(), tag->placements),
                      t.options().device(at::kMeta));
        trace.tagged = DTensor(local, tag->mesh, tag->placements, tag->shape);
      }
      continue;
    }
    const auto effect = last_dim_after(*node);
    if (effect == LastDim::kNew || node->next_edges().empty()) {
      layout_started = layout_started || effect == LastDim::kNew;
      if (other.empty()) other = node->name();
      if (const auto* leaf = dynamic_cast<const torch::autograd::AccumulateGrad*>(node))
        trace.leaves.push_back(leaf->variable);
      continue;
    }
    if (effect == LastDim::kMixed && mixed.empty()) mixed = node->name();
    for (const auto& edge : node->next_edges()) {
      if (edge.function) queue.emplace_back(edge.function.get(), mixed);
    }
  }
  if (trace.tagged) {
    trace.other_gradient = other;
  } else {
    // A walk cut off before any op that starts a layout is taken as one from leaves: a graph of
    // another model's logits reaches its matmul within a few nodes.
    trace.from_leaves_only = !layout_started;
  }
  if (!trace.from_leaves_only) trace.leaves.clear();
  return trace;
}

std::vector<RecentLastDimShard> DTensor::recent_last_dim_shards() {
  std::vector<std::pair<at::Tensor, RecentLastDimShard>> found;
  {
    std::lock_guard<std::mutex> lock(recent_mutex);
    for (const auto& r : recent_shards) {
      at::Tensor local;
      if (auto alive = r.local.lock()) local = at::Tensor(std::move(alive));
      found.push_back(
          {std::move(local), RecentLastDimShard{r.shape, r.mesh_shape, r.placements, std::nullopt}});
    }
  }
  // Outside the lock: a tensor released here may be the last reference of one in the list.
  std::vector<RecentLastDimShard> result;
  for (auto& [local, recent] : found) {
    if (local.defined()) recent.alive = from_tagged(local);
    result.push_back(std::move(recent));
  }
  return result;
}

}  // namespace hyper_parallel::dtensor
