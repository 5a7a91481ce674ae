#pragma once
// The parameters one fully_shard call manages, sharded together over the data-parallel mesh.
//
// Each parameter is cut on dim 0 into torch.chunk pieces over the mesh's shard dim; this rank
// keeps its piece (possibly empty) as the parameter's data, so the optimizer steps on shards and
// its state is sharded too. A forward gathers the group in one all-gather (each rank's pieces,
// padded to the chunk size, in one flat buffer), into buffers whose storage is freed when the
// group is resharded; a backward reduce-scatters the group's gradients in one message into the
// shards' .grad (averaged over the data-parallel ranks), after an all-reduce over the replicate
// dim for HSDP.
//
// Unfused meaning:                        W_i = all_gather(shard_i, dim 0)      for every i
//                                         grad(shard_i) = reduce_scatter(dW_i, dim 0) / dp
// Who waits on whom:
//   - forward: a group's first module waits for the group's gather, then starts the gather of
//     the group that came next in the last pass (implicit prefetch), which travels while this
//     group computes;
//   - backward: a group's pre-backward waits for its gather (if it was resharded) and starts the
//     gather of the group whose backward comes next; as autograd produces the gathered
//     parameters' gradients, they leave in reduce-scatters of about reduce_bucket_cap_bytes
//     (FullyShardOptions), the last when the group's backward is over (with a cap of 0, one
//     reduce-scatter when autograd has them all), and the backward goes on; the reductions of
//     at most two groups travel at once (a third group's start waits for the oldest); the end
//     of the backward waits for the rest and writes the shards' .grad (nn/pending_gradient.h).
//     HSDP's all-reduce over the replicate dim runs when a reduce-scatter is waited for. A
//     parameter with gradient hooks (registered before the forward) ends its bucket, waits for
//     it at once and hands its gradient to autograd, which runs the hooks.
// A gather (prefetched, or unshard()) whose shards changed in place, or were replaced (a write
// to .data), before the forward used it is done again. Shards cast after construction (without a
// policy param_dtype: module.to(dtype)) are gathered in their new dtype from the next gather; a
// cast between a forward and its backward is a c10::ValueError at that backward. A parameter
// that is not this rank's piece (another shape, on meta) is a c10::ValueError at the next
// gather, on every rank.
//
// Contract: every rank of the mesh builds the same groups in the same order and runs the same
// forwards and backwards (the collective order of comm/process_group.h).

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/fully_shard/options.h>

namespace hyper_parallel::fully_shard {

struct GatherStats {
  int64_t gathers = 0, prefetched = 0, regathered = 0;
};

class ParamGroup {
 public:
  /// Shards `params` (each rank keeps its own copy's piece: no communication; every rank must
  /// hold the same values) and records each one's layout: its tensor-parallel layout, if a style
  /// recorded one, with Shard(0) over the data-parallel mesh nested inside it. Meta parameters
  /// (deferred initialization) are sharded as meta: the group gathers once they are replaced by
  /// cpu ones (adopt_parameter). `names` name them in errors. A c10::ValueError for a scalar
  /// parameter, a mesh of another rank than 1 or 2, an offload policy that cannot apply, or a
  /// parameter already sharded by another group.
  ParamGroup(std::vector<at::Tensor> params, std::vector<std::string> names,
             const FullyShardOptions& options);
  ~ParamGroup();
  ParamGroup(const ParamGroup&) = delete;
  ParamGroup& operator=(const ParamGroup&) = delete;

  /// Whose forward a pre_forward / post_forward pair brackets.
  enum class Caller {
    /// A module that owns some of the group's parameters. Called on its own (outside the
    /// forward of the module fully_shard was applied to: checkpoint's recomputation, or a direct
    /// call), it is one of the `users` that make a pass.
    kOwner,
    /// The module fully_shard was applied to: its whole forward is one pass, so a parameter read
    /// anywhere in it is the gathered one (FSDP2's scope), and its end ends the pass.
    kShardedModule,
  };

  /// A managed module's forward begins (`users` modules share the group; the first of a pass
  /// gathers): the gathered parameters, differentiable (their gradient is reduce-scattered into
  /// the shards), in the managed order. A call nested in an open one of the group (an owning
  /// module inside the sharded module's forward) reuses that call's parameters (noting a part of
  /// a pass with grad that runs without, a reentrant checkpoint's region) and gathers nothing.
  /// `rows`: for a row-sparse group, the rows of its one parameter this forward reads (an
  /// embedding's ids): unless a gather of it is under way, only those travel
  /// (comm/gather_rows.h), and the other rows read NaN. Then runs `prefetch` (e.g.
  /// the gathers of set_modules_to_forward_prefetch), unless this forward is a recomputation (see
  /// post_forward), which gathers no group ahead for a later forward. Collective.
  const std::vector<at::Tensor>& pre_forward(const at::Tensor& rows = {},
                                             const std::function<void()>& prefetch = {},
                                             Caller caller = Caller::kOwner);
  /// A managed module's forward ended; true if it was the outermost open call of the group (its
  /// caller then puts the shards back in place of the gathered parameters). The sharded
  /// module's end always is: it ends the calls of its owners that raised inside it. Once all
  /// `users` (owners called on their own) have run, or the sharded module's forward has, the
  /// group reshards (if reshard_after_forward) and the next pre_forward starts a new pass.
  ///
  /// A forward with grad inside a backward is torch.utils.checkpoint's recomputation: it gathers
  /// the group if it was resharded, starts the gather of the group whose backward comes next,
  /// and keeps the group gathered until its backward ends. Its pre_forward returns the views of
  /// the pass it recomputes (the non-reentrant variant reads only the recomputed graph's saved
  /// tensors), or, for a part that pass ran without grad (the reentrant variant), views whose
  /// gradients, from the nested backward, join that pass's reduction; the parameters the
  /// backward does not reach are then judged at its end. A forward without grad inside a
  /// backward (a hook's) is not one: it reshards a group whose backward is not under way.
  bool post_forward(Caller caller = Caller::kOwner);
  /// A forward of the group raised (its post_forward will not come): its open calls are over, and
  /// the next pre_forward begins a new pass.
  void abandon_forward();
  /// `outputs` of a managed module, each passed through a node whose backward gathers the group
  /// again (if it was resharded) before the module's own backward reads its parameters, then
  /// runs `then` (e.g. gathering the modules to prefetch).
  std::vector<at::Tensor> register_pre_backward(std::vector<at::Tensor> outputs,
                                                const std::function<void()>& then = {});
  /// Views of the gathered parameters, for the owning modules to hold in place of the shards
  /// while the backward of the module fully_shard was applied to runs (from its outputs'
  /// gradients to its inputs', or to the end of the backward: FSDP2's pre- and post-backward),
  /// so code that reads a parameter itself there (a checkpointed region's recomputation,
  /// outside every module's forward) reads it whole. The group's buffers stay until
  /// release_backward_views, also if its reduction is over before. A gradient that reaches a
  /// view (the nested backward of a reentrant checkpoint whose region read the parameter)
  /// arrives in the group's buckets if they still take it, and is otherwise reduce-scattered on
  /// its own and added to the shard's .grad (kept, while sync is off, for the next synced
  /// backward): every rank's region reads alike, so every rank reduces it at the same point.
  /// None for a row-sparse group (its backward reads no weight) or while a forward
  /// call of the group is open (a backward inside a forward: that call's parameters stay).
  std::vector<at::Tensor> backward_views();
  /// The module's backward is over: the backward views no longer stand in (the caller put the
  /// shards back), and the buffers are freed if the group's backward is over too.
  void release_backward_views();

  /// Gathers the parameters now (outside a forward, e.g. to read them whole); async_op: starts
  /// the gather and returns (the next pre_forward or wait_for_unshard waits for it). Collective.
  void unshard(bool async_op = false);
  /// Waits for a gather started by unshard(true) or a prefetch (gathers now if none is).
  void wait_for_unshard();
  /// Gives `groups` (a root's and every group under it) one pass order: the implicit prefetch
  /// follows the order their forwards ran in, per root. A group's index in `groups` (the same
  /// on every rank) names its gradient reductions in the ranks' agreement.
  static void share_pass_order(const std::vector<ParamGroup*>& groups);
  /// How many gathers this group did, how many of them were in flight before their use, and how
  /// many were done again because the shards changed in place after a prefetch read them.
  GatherStats gather_stats() const;
  /// Frees the gathered parameters' storage.
  void reshard();
  bool is_unsharded() const;

  void set_users(int64_t users);
  /// false: backwards add the gathered gradients up here; the next backward with sync on
  /// reduce-scatters the sum (FSDP's no_sync).
  void set_requires_gradient_sync(bool sync);
  /// false (HSDP): a synced backward reduce-scatters the gradients over the shard dim and adds
  /// them to sums the group holds, without the all-reduce over the replicate dim and without
  /// writing .grad; the next backward with all-reduce on adds the held sums to its own before its
  /// all-reduce, or, if it does not reach the group, all-reduces them at its end. No effect on a
  /// 1-d mesh (a reduce-scatter alone completes the gradient there).
  void set_requires_all_reduce(bool all_reduce);
  void set_reshard_after_forward(bool reshard);
  /// false: the group stays gathered after its backward, and the next forward gathers only if
  /// the shards changed since (an optimizer step): micro-batches of gradient accumulation.
  void set_reshard_after_backward(bool reshard);
  /// Multiplies the reduced gradients (after the average over the data-parallel ranks).
  void set_gradient_scaling_factor(double factor);
  /// How the data-parallel ranks' gradients combine: comm::ReduceOp::kAvg (the default) or kSum
  /// (the original's reduce op type "sum": no division by the data-parallel size), in the
  /// reduce-scatter and in HSDP's all-reduce alike. Takes effect at the next reduction; a
  /// c10::ValueError while the group holds sums reduce-scattered with the other op.
  void set_reduce_op(comm::ReduceOp op);
  /// FSDP2's: the ranks' gradients are summed and divided by `factor` (set_reduce_op(kSum) and a
  /// scaling factor of 1 / factor). A c10::ValueError unless factor is finite and > 0.
  void set_gradient_divide_factor(double factor);
  /// Its check alone (for a module whose parameters other groups took: nothing to set).
  static void check_gradient_divide_factor(double factor);
  /// true: the group's one parameter is an embedding's table, read by one module's forward at the
  /// rows of its ids and not at all by its backward. Its forward gathers only those rows (see
  /// pre_forward), it is not prefetched or gathered again for the backward, and its gradient's
  /// reduce-scatter sends only the rows with bits (comm/row_sparse_reduce_scatter.h): the
  /// dense results' bits. A c10::ValueError for a group of more than one parameter or of a
  /// parameter of fewer than 2 dims.
  void set_row_sparse_gradients(bool row_sparse);

  /// The managed parameters (their data is this rank's shard).
  const std::vector<at::Tensor>& parameters() const;
  /// The gathered parameters of the current forward pass (pre_forward's result).
  const std::vector<at::Tensor>& gathered() const;
  /// Parameter i becomes `param`, a new tensor a conversion made for it (torch's
  /// Module._apply from meta to cpu: module.to_empty after fully_shard): the group gathers it
  /// from now on, and it is managed and laid out as the one it replaces (the caller puts it in
  /// the modules that held the old one: a C++ module registers it anew). Its shape is checked by
  /// the next gather. A c10::ValueError for a tensor another group manages, or while the group
  /// is gathered or a gather of it is under way.
  void adopt_parameter(int64_t i, const at::Tensor& param);
  /// Whether some group manages `param`.
  static bool is_managed(const at::Tensor& param);
  /// The index of `param` (the managed tensor or an alias of it) in parameters(); -1 if absent.
  int64_t index_of(const at::Tensor& param) const;
  /// The data-parallel mesh.
  const dtensor::DeviceMesh& mesh() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace hyper_parallel::fully_shard
