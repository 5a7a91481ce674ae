#pragma once
// fully_shard: sharded data parallelism (PyTorch FSDP2's and HyperParallel's semantics) over the
// data-parallel dim of a mesh, composed with tensor parallelism over another dim of it.
//
// fully_shard(module) makes one ParamGroup (param_group.h) of the parameters of `module` and its
// descendants that no earlier fully_shard call took, so it is applied bottom-up: each block,
// then the root for what is left. Each parameter keeps only this rank's dim-0 piece; before a
// managed module computes, the group's pieces are gathered (one all-gather), and the gradient
// flows back into the pieces through one reduce-scatter per group, averaged over the
// data-parallel ranks. The modules must be this library's (hyper_parallel::nn Linear, Embedding,
// RMSNorm): their forward reads parameters through the hook fully_shard fills
// (HookableModule::set_parameter_view), so the model's code does not change.
//
// Usage (2-D: FSDP over dp, TP over tp):
//   auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
//   parallelize_module(*model, mesh["tp"], plan);                 // TP first
//   for (auto& block : *model->layers) fully_shard(*block, FullyShardOptions().mesh(mesh["dp"]));
//   fully_shard(*model, FullyShardOptions().mesh(mesh["dp"]));
//   torch::optim::AdamW optimizer(model->parameters(), ...);      // steps on the shards

#include <memory>
#include <optional>
#include <vector>

#include <hyper_parallel/core/fully_shard/options.h>
#include <hyper_parallel/core/fully_shard/param_group.h>

namespace torch::nn {
class Module;
}

namespace hyper_parallel::fully_shard {

/// The handle of a module fully_shard was applied to.
class FSDPModule {
 public:
  /// The handle of `module`, or nullopt if fully_shard was not applied to it.
  static std::optional<FSDPModule> of(torch::nn::Module& module);

  /// Gathers this module's parameters now (not recursive); async_op: starts the gather, which
  /// the module's next forward (or wait_for_unshard) waits for. Collective.
  void unshard(bool async_op = false) const;
  /// Waits for a gather unshard(true) started.
  void wait_for_unshard() const;
  /// Frees them (not recursive).
  void reshard() const;
  /// false: the backward keeps adding the gathered gradients up, without communication; the next
  /// backward with sync on reduce-scatters the sum. `recurse`: for the managed modules below too.
  void set_requires_gradient_sync(bool sync, bool recurse = true) const;
  /// false (HSDP): the backward reduce-scatters over the shard dim only, into sums the groups hold,
  /// and leaves .grad as it is; the next backward with all-reduce on all-reduces the held sums
  /// with its own over the replicate dim and writes .grad (gradient accumulation with one
  /// all-reduce per step). No effect on a 1-d mesh.
  void set_requires_all_reduce(bool all_reduce, bool recurse = true) const;
  void set_reshard_after_forward(bool reshard, bool recurse = true) const;
  /// false: the parameters stay gathered after the backward, so the next forward (of the next
  /// micro-batch) does not gather them again unless an optimizer step changed them.
  void set_reshard_after_backward(bool reshard, bool recurse = true) const;
  /// Multiplies this module's reduced gradients (after the average over the dp ranks).
  void set_gradient_scaling_factor(double factor) const;
  /// kAvg (the default) or kSum: how the dp ranks' gradients of this module's group combine
  /// (not recursive, as the original's set_reduce_op_type).
  void set_reduce_op(comm::ReduceOp op) const;
  /// FSDP2's: the dp ranks' gradients of this module's group are summed and divided by `factor`
  /// (> 0; FSDP2's default divides by the dp size, as kAvg). Sets the reduce op to kSum and the
  /// gradient scaling factor to 1 / factor (not recursive).
  void set_gradient_divide_factor(double factor) const;
  /// The modules whose gathers start as soon as this one's forward / backward begins (they
  /// travel while it computes), beside the implicit prefetch of the next module in the order
  /// the last pass ran them.
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) const;
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) const;
  /// Drops the .grad and main gradient (nn/main_grad.h) of every parameter this module (and those
  /// below it) manages.
  void zero_grad() const;
  /// This module's own group; nullptr when nested calls took all its parameters.
  ParamGroup* group() const;

  struct State;

 private:
  explicit FSDPModule(std::shared_ptr<State> state) : state_(std::move(state)) {}
  friend FSDPModule fully_shard(torch::nn::Module&, const FullyShardOptions&);
  friend std::vector<FSDPModule> fully_shard(const std::vector<torch::nn::Module*>&,
                                             const FullyShardOptions&);
  std::shared_ptr<State> state_;
};

/// Shards `module`'s parameters that no earlier call took over `options.mesh()` and installs the
/// gathering and reducing hooks on the modules that own them. A c10::ValueError if a parameter
/// belongs to a module without hook points, if `module` is already managed, or for the
/// options ParamGroup refuses. Collective over the mesh.
FSDPModule fully_shard(torch::nn::Module& module, const FullyShardOptions& options = {});

/// One group of the parameters of several modules (and their descendants) that no earlier call
/// took, FSDP2's fully_shard([...]) (`fully_shard({model.norm.get(), model.head.get()}, options)`):
/// the first of them whose forward runs gathers it, and it is resharded once each of their
/// modules owning parameters has run. A module listed twice, or below another of the list, is a
/// part of that one. Returns the handles of the rest, in the list's order (they share the group). A
/// c10::ValueError for an empty list, a nullptr, or a module already managed (naming its index), beside the
/// single module's errors. Collective over the mesh.
std::vector<FSDPModule> fully_shard(const std::vector<torch::nn::Module*>& modules,
                                    const FullyShardOptions& options = {});

}  // namespace hyper_parallel::fully_shard
