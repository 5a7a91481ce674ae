#pragma once
// DTensor: a local tensor plus the mesh, placements and global shape that say which part of a
// global tensor it is. Every conversion is differentiable: gradients flow back to the local
// tensors, redistributed to the placements they came from.
//
// Gradient placements: a gradient arrives with the placements its consumer gives it
// (to_local(grad_placements)), otherwise with the forward placements (Partial read as
// Replicate). E.g. the input of a column-parallel matmul receives a Partial gradient, so the
// backward of its Shard -> Replicate all-gather is a reduce-scatter.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <hyper_parallel/core/dtensor/device_mesh.h>
#include <hyper_parallel/core/dtensor/placement.h>

namespace hyper_parallel::dtensor {

/// Options of DTensor::from_local.
///
/// Usage:
///   DTensor::from_local(x, mesh, {Shard(0)}, FromLocalOptions().run_check(true));
struct FromLocalOptions {
  /// Exchange local shapes over the mesh to compute the exact global shape (uneven shards, split
  /// as torch.chunk splits, allowed; another split, or a shape() the shards do not make, is a
  /// ValueError on every rank), and give each Replicate mesh dim's replicas the data of its
  /// coordinate 0, as torch's run_check. Costs one small all_gather per mesh dim and a broadcast
  /// per Replicate mesh dim.
  TORCH_ARG(bool, run_check) = false;
  /// The global shape, if known; otherwise local extents times mesh size (even sharding).
  TORCH_ARG(std::optional<std::vector<int64_t>>, shape) = std::nullopt;
};

struct RecentLastDimShard;
struct TaggedTrace;

class DTensor {
 public:
  /// Wraps this rank's `local` shard. No communication unless options.run_check().
  static DTensor from_local(const at::Tensor& local, const DeviceMesh& mesh, const Placements& placements,
                            const FromLocalOptions& options = {});

  /// The local shard; gradients flowing into it take this DTensor's placements.
  const at::Tensor& to_local() const { return local_; }
  /// The local shard for a consumer whose gradient has `grad_placements` (e.g. Partial after a
  /// column-parallel matmul consumed a Replicate input), as in PyTorch. Other consumers of this
  /// DTensor may give gradients in its own placements (a residual add of the local tensor) or
  /// declare others: each kind is summed apart and converted once in backward, so a Partial
  /// sum from several column layers reduces once.
  at::Tensor to_local(const Placements& grad_placements) const;

  /// The local shard, remembered as this DTensor: a consumer that calls DTensor::from_tagged on
  /// it gets this DTensor back (same placements, and gradient placements it declares reach this
  /// DTensor's producer). The C++ stand-in for passing a DTensor between modules
  /// (use_local_output=false in the parallel styles).
  at::Tensor to_local_tagged() const;
  /// The DTensor whose to_local_tagged() returned `local`, if any (and `local` is that very
  /// tensor, still alive).
  static std::optional<DTensor> from_tagged(const at::Tensor& local);
  /// `to` holds `from`'s values, laid out alike (an identity node or a cast a wrapper put
  /// between modules: fully_shard's, a mixed-precision policy's): if `from` is tagged, `to` is
  /// tagged as the same DTensor, so the next module's style reads its layout. Returns `to`.
  static at::Tensor carry_tag(const at::Tensor& from, const at::Tensor& to);
  /// What the first `max_nodes` nodes of `t`'s autograd graph say of the tagged DTensor `t` was
  /// computed from (a cast, a scale, rows selected): see TaggedTrace. The walk stops at a matmul or
  /// another DTensor's node; a tensor without a graph (computed under no_grad) is not traced back.
  static TaggedTrace trace_back(const at::Tensor& t, int64_t max_nodes = 64);
  /// The local tensors tagged (to_local_tagged, by any thread) whose DTensor shards its last dim,
  /// newest first: those still alive and the last eight that are gone. Their layouts,
  /// and the DTensor while its local tensor is alive. For a consumer given a tensor with no autograd graph to
  /// trace (computed under no_grad, or after detach) that may hold one of these shards.
  static std::vector<RecentLastDimShard> recent_last_dim_shards();

  /// Moves the data to `placements` (docs/tp-semantics.md: Shard->Replicate all_gather,
  /// Partial->Replicate all_reduce, Partial->Shard reduce_scatter, Replicate->Shard local slice,
  /// Shard(i)->Shard(j) all_to_all). Backward moves the gradient back.
  DTensor redistribute(const Placements& placements) const;
  /// The same, spelled as torch's and the original's redistribute(device_mesh, placements):
  /// `mesh` must be this DTensor's own (moving to another mesh is a NotImplementedError).
  DTensor redistribute(const DeviceMesh& mesh, const Placements& placements) const;
  /// Each Partial mesh dim reduced (to Replicate), the others kept.
  DTensor reduce_partial() const;

  /// This DTensor's layout over `local`, another tensor of this rank's local shape (a cast or a
  /// copy of to_local()): differentiable, as from_local.
  DTensor with_local(const at::Tensor& local) const;
  /// Copies `src`'s values into this DTensor's local shard: `src` is on the same mesh, of the
  /// same global shape (redistributed to these placements first if laid out otherwise: then
  /// collective) or one replicated element (broadcast). Returns *this.
  const DTensor& copy_(const DTensor& src) const;

  /// The global tensor on every rank (redistribute to Replicate, then to_local).
  at::Tensor full_tensor() const;

  const DeviceMesh& device_mesh() const { return mesh_; }
  const Placements& placements() const { return placements_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  /// Elements of the global tensor.
  int64_t numel() const;
  at::ScalarType scalar_type() const { return local_.scalar_type(); }
  bool requires_grad() const { return local_.requires_grad(); }
  std::string str() const;

  /// Internal (dtensor.cpp): where the gradients consumers declared in other placements wait for
  /// this DTensor's producer.
  struct GradSlot;

 private:
  DTensor(at::Tensor local, DeviceMesh mesh, Placements placements, std::vector<int64_t> shape);
  at::Tensor local_;
  DeviceMesh mesh_;
  Placements placements_;
  std::vector<int64_t> shape_;
  std::shared_ptr<GradSlot> grad_slot_;

  friend DTensor distribute_tensor(const at::Tensor&, const DeviceMesh&, const Placements&,
                                   std::optional<int64_t>);
};

/// What DTensor::trace_back finds on a tensor's autograd graph.
struct TaggedTrace {
  /// The layout of the tagged DTensor the tensor was computed from, as a DTensor whose local
  /// tensor is on the meta device (the tagged tensor itself may be gone); nullopt if none.
  std::optional<DTensor> tagged;
  /// The first op on the path to it that may mix the last dim (a softmax, a slice of it), or "".
  std::string mixed_by;
  /// With `tagged`: the first op found that takes a gradient to something else (a learnable
  /// temperature's AccumulateGrad, a gate's matmul), or "". Computed beside one rank's shard of
  /// the last dim, such a gradient is that rank's part only.
  std::string other_gradient;
  /// Without `tagged`: whether no op on the graph, as far as the walk went, starts a layout: the
  /// tensor was computed from leaves alone (a detached copy made to require grad), or through more
  /// nodes than `max_nodes` that keep the last dim, and where its values came from is not traced.
  bool from_leaves_only = false;
  /// With from_leaves_only: the tensors at its leaves (those their AccumulateGrad nodes add
  /// into): the detached copy itself, or another operand that takes a gradient.
  std::vector<at::Tensor> leaves;
};

/// A DTensor tagged recently that shards its last dim (DTensor::recent_last_dim_shards).
struct RecentLastDimShard {
  std::vector<int64_t> shape;       // global
  std::vector<int64_t> mesh_shape;  // of the mesh it was on
  Placements placements;
  std::optional<DTensor> alive;  // while its local tensor is
};

/// Splits a full tensor over the mesh, as torch.distributed.tensor.distribute_tensor does.
/// `src_data_rank` is the source's coordinate on every mesh dim (group rank src_data_rank of each
/// dim's group; default 0): that rank's tensor is broadcast first, so all ranks shard the same
/// data. On a mesh sliced from a larger one (mesh["tp"]) it names a rank of each slice, not a
/// global rank. With nullopt every rank already holds the full tensor and shards its own copy,
/// with no communication. Partial placements are rejected. Differentiable: the gradient of the
/// full tensor is the gathered gradient.
///
/// Usage:
///   auto w = distribute_tensor(full, tp_mesh, {Shard(0)});          // tp rank 0's values
///   auto mine = distribute_tensor(full, tp_mesh, {Shard(0)}, std::nullopt);  // no communication
DTensor distribute_tensor(const at::Tensor& tensor, const DeviceMesh& mesh, const Placements& placements,
                          std::optional<int64_t> src_data_rank = 0);

/// Redistributes a local tensor between placements without autograd (the engine under
/// DTensor::redistribute, exposed for this library's styles and fused ops).
at::Tensor redistribute_local(const at::Tensor& local, const DeviceMesh& mesh,
                              const std::vector<int64_t>& global_shape, const Placements& from,
                              const Placements& to);

}  // namespace hyper_parallel::dtensor
