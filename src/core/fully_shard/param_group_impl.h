#pragma once
// Internal: a fully_shard group's state, shared by its gathers (param_group.cpp), its gradient
// reductions (param_group_reduce.cpp), the parameters a backward does not reach
// (unreached_parameters.cpp), its recomputation under activation checkpointing
// (recomputation.cpp) and its held sums (held_sums.cpp).

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/op.h>
#include <hyper_parallel/core/comm/pending_all_gather.h>
#include <hyper_parallel/core/comm/process_group.h>
#include <hyper_parallel/core/dtensor/device_mesh.h>
#include <hyper_parallel/core/fully_shard/param_group.h>

#include "flat_layout.h"
#include "pass_order.h"

namespace torch::autograd {
struct Node;
}  // namespace torch::autograd

namespace hyper_parallel::fully_shard {

namespace detail {
struct ReduceInFlight;
// A shard as a forward read it: its version and its storage (a .data write replaces it).
struct ShardState {
  int64_t version = 0;
  const void* storage = nullptr;
};
}  // namespace detail

struct ParamGroup::Impl : std::enable_shared_from_this<ParamGroup::Impl> {
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  detail::FlatLayout layout;
  std::vector<at::Tensor> buffers;   // the gathered parameters' storage, freed when resharded
  std::vector<at::Tensor> gathered;  // this pass's differentiable views of the buffers
  std::vector<at::Tensor> pending;   // gradients added up while sync is off
  // HSDP with all_reduce off: per parameter, the reduce-scatters' results held for the next
  // all-reduce (this rank's padded block, in the reduce dtype), and whether any rank had a gradient.
  std::vector<at::Tensor> partial;
  std::vector<bool> partial_reached;
  dtensor::DeviceMesh mesh;
  comm::Group shard_group;
  std::optional<comm::Group> replicate_group;
  at::ScalarType gather_dtype = at::kFloat;    // the buffers' dtype
  std::optional<at::ScalarType> policy_dtype;  // MixedPrecisionPolicy param_dtype: fixes it
  // Bumped when the buffers are made anew (a cast, to_empty) or a parameter is replaced
  // (adopt_parameter): a graph made before reads tensors no longer gathered.
  int64_t generation = 1;
  std::optional<at::ScalarType> reduce_dtype;
  bool to_main_grad = false;  // MixedPrecisionPolicy apply_grad_on_fp32_main_grad
  bool reshard_after_forward = true, sync = true, unsharded = false;
  bool all_reduce = true;              // false: HSDP's reductions stop after the reduce-scatter (partial)
  bool reshard_after_backward = true;  // false: the next forward finds the group gathered
  bool backward_prefetched = false;    // this backward of the group has started the next gather
  bool backward_began = false;         // this pass's pre-backward has run
  double scale = 1.0;
  comm::ReduceOp reduce_op = comm::ReduceOp::kAvg;  // over the data-parallel ranks
  int64_t row_sparse_cols = 0;                      // > 0: the one parameter's gradient reduces row-sparse
  bool rows_by_id = false;                          // row-sparse, and a forward's ids index this rank's rows
  int64_t users = 1, forward_calls = 0;
  int64_t open_calls = 0;           // forwards of the group's modules under way, one inside the other
  bool gathered_with_grad = false;  // this pass's views: made with grad mode on
  // The views of the last pass with grad, until its backward is over (a recomputation reuses
  // them; a pass without grad in between leaves them).
  std::vector<at::Tensor> grad_views;
  // That pass ran part of the group without grad (a reentrant checkpoint's region), or it is a
  // reentrant recomputation's: a backward may reach its parameters through graphs made later,
  // so those it does not reach are judged at its end, not at the group's first gradient.
  bool part_without_grad = false, reached_later = false;
  // Backward views stand in for the shards (ParamGroup::backward_views): the buffers stay until
  // they are released, also if the group's backward is over before (free_when_released).
  bool views_out = false, free_when_released = false;
  std::shared_ptr<detail::PassOrder> order = std::make_shared<detail::PassOrder>();
  int64_t position = 0;  // in its root's groups (the same on every rank): names its ops
  int64_t serial = 0;    // groups made in this process before it (the same on every rank)
  std::optional<comm::PendingAllGather> gather_in_flight;  // started ahead of its use
  std::vector<int64_t> versions_at_gather;                 // the shards' versions it read
  std::vector<at::Tensor> read_at_gather;  // aliases of the shards it read (a .data write replaces them)
  GatherStats stats;

  // Reduction in buckets (param_group_reduce.cpp): this backward's gradients, by parameter, as
  // autograd produced them; those not yet in a started bucket, in arrival order, and their bytes.
  int64_t bucket_cap_bytes = 0;
  std::vector<at::Tensor> arrived_grads;
  std::vector<bool> arrived;
  std::vector<size_t> unsent;
  int64_t unsent_bytes = 0;
  size_t arrivals = 0, expected_arrivals = 0;
  int64_t expected_bytes = 0;  // of the gradients this backward produces
  // The buckets of the first synced backward, in the order they started (each in parameter
  // order), and those of this one while it records them; the plan's next bucket to start.
  std::vector<std::vector<size_t>> bucket_plan, recorded_plan;
  std::vector<int> planned_wants;  // per parameter when it was made: wants(i)
  // This backward's started bucket of each parameter, and the parameter's place in it.
  std::vector<std::shared_ptr<detail::ReduceInFlight>> reduce_of;
  std::vector<int64_t> offset_of;
  std::vector<size_t> slot_of;  // the parameter's place among its bucket's
  // This pass's autograd node of each parameter, and whether this backward reaches it (one it
  // does not reach arrives with zeros, at the latest at the end of the backward).
  std::vector<torch::autograd::Node*> reduce_nodes;
  std::vector<bool> reached;
  bool arriving_unreached = false;  // arrive_unreached is running: its caller ends the backward
  bool reduced_whole = false;       // a whole-group reduce-scatter has been agreed with the peers
  bool end_queued = false;          // this backward's end will bring its missing gradients
  size_t next_bucket = 0;

  explicit Impl(dtensor::DeviceMesh m) : mesh(std::move(m)) {}
  void start_gather();
  void finish_gather();
  // A forward's gather: the rows of `rows` (row-sparse), or the whole group, gathered again if
  // its shards changed in place since.
  void gather_for_forward(const at::Tensor& rows);
  // A forward outside any backward: the gathered views of its pass (ParamGroup::pre_forward).
  static const std::vector<at::Tensor>& forward_pass(const std::shared_ptr<Impl>& group,
                                                     const at::Tensor& rows);
  // A backward runs on this thread: a forward now is a recomputation (recomputation.cpp), or a
  // hook's without grad.
  static bool in_backward();
  // checkpoint's recomputation of a forward, inside the backward (ParamGroup::pre_forward).
  static const std::vector<at::Tensor>& recompute(const std::shared_ptr<Impl>& group, const at::Tensor& rows);
  std::vector<at::Tensor> plain_views() const;
  void note_part_without_grad();
  // Starts the gather of the group whose backward follows this one's, once per backward.
  void prefetch_next_backward(const std::shared_ptr<Impl>& self);
  void gather_rows(const at::Tensor& ids);
  void free_buffers();
  // Before a gather into the buffers (not gathered, none in flight): an error on every rank if
  // some rank's parameters are not its pieces (piece_problem); the buffers made anew if they are
  // stale (module.to(dtype) or to_empty after fully_shard).
  void prepare_gather();
  // Why this rank's parameters cannot be gathered (not this rank's piece, on meta, one dtype not
  // shared without a policy dtype); empty if they can.
  std::string piece_problem() const;
  // Enters the group's gather under a content no rank that can gather names, so that every rank
  // fails rather than waiting for this one, then raises `problem` (a c10::ValueError).
  [[noreturn]] void fail_on_every_rank(const std::string& problem);
  // Whether the shards' dtype (without a policy dtype) or device is no longer the buffers'.
  bool buffers_stale() const;
  // The backward of a forward made at generation `made`: a c10::ValueError if the group's
  // parameters were converted or replaced since, or are now stale for the buffers (a cast not yet
  // gathered): that graph's views are of buffers no longer (or not to be) gathered.
  void check_not_converted_since(int64_t made) const;
  // The shards as they are now.
  std::vector<detail::ShardState> shard_states() const;
  // The backward of a forward that read the shards as `read`: a c10::ValueError if one changed in
  // place since (the backward would pair the forward's activations with other values), except in
  // a row-sparse group (an embedding's backward reads no weight).
  void check_unchanged_since(const std::vector<detail::ShardState>& read) const;
  // Whether this unfinished pass will not end by itself (pre_forward then begins a new one).
  bool pass_left_open() const;
  // Whether the gathered parameters of an unfinished pass are gone or stale (shards changed).
  bool pass_outdated() const;
  // Whether a shard changed in place, or its data was replaced, since the last gather read it.
  bool shards_changed() const;

  // The gathered views of this pass, each parameter's gradient reduced when autograd has every
  // one of them (one reduce-scatter), or as they come, in buckets.
  static std::vector<at::Tensor> attach_reduction(const std::shared_ptr<Impl>& group,
                                                  std::vector<at::Tensor> views);
  // Views whose gradients each reach arrive (one node per parameter).
  static std::vector<at::Tensor> attach_per_parameter(const std::shared_ptr<Impl>& group,
                                                      std::vector<at::Tensor> views);
  // A whole-group node's gradients, when part of its pass reduces per parameter: each defined
  // one arrives.
  static std::vector<at::Tensor> arrive_each(const std::shared_ptr<Impl>& self,
                                             std::vector<at::Tensor> grads);
  // Whether this pass reduces in buckets: a cap (or reached_later), several parameters, dense.
  bool reduces_in_buckets() const;
  // The bytes at which a bucket leaves (none without a cap).
  int64_t bucket_cap() const;
  // The bucketed reduction's state for a backward (the forward sets it up).
  void begin_backward_pass();
  // The whole group's gradients (autograd has them all): reduced in one reduce-scatter.
  std::vector<at::Tensor> reduce(std::vector<at::Tensor> grads);
  // Parameter i's gradient, in the bucketed reduction; returns its reduced shard gradient for
  // autograd if it has gradient hooks (undefined otherwise: deferred).
  at::Tensor arrive(size_t i, at::Tensor grad);
  // Waits for hooked parameter i's bucket and returns its shard gradient.
  at::Tensor hooked_gradient(size_t i);
  // Bytes of parameter i's gradient in the reduce-scatter's input, and of those arrived.
  int64_t reduce_bytes(size_t i) const;
  int64_t arrived_bytes() const;
  // Adds parameter i's gradient to those kept while sync is off, once the backward completes.
  void accumulate(size_t i, const at::Tensor& grad);
  // Parameter i's gradient through a backward view (ParamGroup::backward_views): it arrives, or
  // is reduced alone. Returns what arrive returns (for autograd), or an undefined one.
  at::Tensor reduce_read_in_backward(size_t i, at::Tensor grad);
  // A gradient of parameter i apart from its arrival in this backward: reduce-scattered on its
  // own into .grad (kept, while sync is off, with the sums).
  void reduce_alone(size_t i, at::Tensor grad);
  // Starts the reduce-scatter of the gradients not yet sent (the first synced backward).
  void send_unsent();
  // Starts the planned buckets whose gradients have all arrived (the later backwards).
  void send_planned();
  // Starts the reduce-scatter of bucket `indices` and defers its parameters' gradients to it.
  void send(const std::vector<size_t>& indices, comm::Agreement agreement);
  // When hooked parameter `current`'s planned bucket is held back: the parameters this backward
  // does not reach reduce zeros now.
  void arrive_unreached(size_t current);
  // A backward that captures (torch.autograd.grad) or leaves out (inputs=) the gradient of one
  // of these parameters, which a reduction would add to .grad or the kept sums instead: a
  // c10::NotImplementedError, on every rank that runs it.
  void check_accumulating_backward(const std::vector<size_t>& indices) const;
  // Parameter i, which this backward does not reach, arrives without a gradient (its bucket
  // carries zeros and a flag saying it has none).
  void arrive_without_gradient(size_t i);
  // At the end of the backward: the parameters that got no gradient reduce zeros.
  void arrive_missing();
  // Queues arrive_missing at the end of the backward running now (once per backward).
  static void queue_end_of_backward(const std::shared_ptr<Impl>& group);
  // Whether the group holds sums kept while sync was off, or reduce-scattered sums waiting for
  // the all-reduce (held_sums.h).
  bool holds_sums() const;
  // Whether it holds reduce-scattered sums waiting for the all-reduce.
  bool holds_partial_sums() const;
  // Whether this group's reductions now stop after the reduce-scatter: HSDP, all_reduce off.
  bool defers_all_reduce() const;
  // Adds reduced parameter i's block (and whether any rank had a gradient) to its partial.
  void hold_partial(size_t i, const at::Tensor& block, bool reached_anywhere);
  // The partial sums of parameters `indices` that want a gradient, in the reduce-scatter's
  // output layout (`elements` elements, then `flags` flags), taken from the group into `into`
  // (its partial, and what it took); none if none is held.
  void take_partial(const std::vector<size_t>& indices, int64_t elements, int64_t flags, at::ScalarType dtype,
                    detail::ReduceInFlight& into);
  // A failed backward dropped parameter i's share of `reduce`: the sums it took are held again.
  void put_back(const detail::ReduceInFlight& reduce, size_t i);
  // Reduces the sums kept while sync (or the all-reduce) was off, if this backward did not reach
  // the group.
  void reduce_held_sums();
  // The group's backward is over: the last bucket leaves and the gathered parameters are freed.
  void end_backward();
  // What parameter i wants from a backward now: 0 no gradient (frozen), 1 a gradient, 2 one its
  // gradient hooks must see.
  int wants(size_t i) const;
  // The group in messages: its first parameters' names.
  std::string label() const;
  // 0, 1, ..., the group's parameters' indices.
  std::vector<size_t> all_params() const;
  // What a gather or reduce-scatter of parameters `indices` carries, named the same on every rank
  // (comm::OpSignature::content): ranks moving different parameters of one size, or parameters
  // that want different things from the backward (a rank's own bucket plan), get an error.
  int64_t content_of(const std::vector<size_t>& indices) const;
  // Starts the reduce-scatter of parameters `indices` (gradients by parameter index; an
  // undefined one: none on this rank).
  std::shared_ptr<detail::ReduceInFlight> start_reduce(const std::vector<size_t>& indices,
                                                       std::vector<at::Tensor>& grads,
                                                       comm::Agreement agreement);
  // Parameter i's shard gradient goes to .grad (to_main_grad: is added to its main gradient)
  // when `reduced` (its bucket, from element `offset`) is waited for (nn/pending_gradient.h);
  // with run_hooks, its hooks first see it, as in its AccumulateGrad (for a parameter autograd
  // does not reach).
  void defer_to_grad(const std::shared_ptr<detail::ReduceInFlight>& reduced, size_t i, int64_t offset,
                     size_t slot, bool run_hooks);
  // Parameter i's reduced shard gradient from `reduce`, which reduced it at element `offset`, in
  // the shard's dtype (keep_reduce_dtype: the reduction's). Undefined if no rank had a gradient
  // for it (`slot`: its place in the reduction).
  static at::Tensor shard_gradient(const std::shared_ptr<detail::ReduceInFlight>& reduce,
                                   const at::Tensor& param, int64_t offset, int64_t elements, size_t slot,
                                   bool keep_reduce_dtype = false);
  // With to_main_grad, the gradients go to main_grad, not through autograd's hooks: a group
  // whose parameters have hooks is refused (c10::NotImplementedError).
  void check_no_hooks_for_main_grad() const;
};

namespace detail {
// The group a backward node names by a weak pointer; an error if the group was destroyed.
std::shared_ptr<ParamGroup::Impl> alive(const std::weak_ptr<ParamGroup::Impl>& weak);
}  // namespace detail

}  // namespace hyper_parallel::fully_shard
