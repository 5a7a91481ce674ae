#include <hyper_parallel/core/fully_shard/param_group.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>

#include <ATen/ATen.h>
#include <ATen/native/Resize.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <hyper_parallel/core/comm/chunks.h>
#include <hyper_parallel/core/comm/collectives.h>
#include <hyper_parallel/core/comm/gather_rows.h>
#include <hyper_parallel/core/comm/pending_all_gather.h>
#include <hyper_parallel/core/nn/parameter_layout.h>

#include "../util/weak_tensor_map.h"
#include "param_group_impl.h"

namespace hyper_parallel::fully_shard {
namespace {

// The parameters some group manages: one group per parameter.
hyper_parallel::detail::WeakTensorMap<bool>& managed() {
  static hyper_parallel::detail::WeakTensorMap<bool> table;
  return table;
}

std::string mixed_dtypes(const std::string& first, at::ScalarType a, const std::string& other,
                         at::ScalarType b) {
  return c10::str(
      "fully_shard: expected one dtype for a group's parameters (or a MixedPrecisionPolicy "
      "param_dtype), got ",
      a, " for ", first, " and ", b, " for ", other);
}

// Storage bytes of `t`'s view, from nothing (resharded) back to what its sizes need, or freed.
void set_storage(const at::Tensor& t, bool allocated) {
  if (t.is_meta()) return;  // no memory to free (a meta group's buffers, until materialized)
  auto* storage = t.storage().unsafeGetStorageImpl();
  const size_t bytes = allocated ? static_cast<size_t>(t.numel()) * t.element_size() : 0;
  if (storage->nbytes() != bytes) at::native::resize_bytes_cpu(storage, bytes);
}

// The data-parallel layout nested inside the tensor-parallel one a style recorded, if any.
nn::ParameterLayout composed_layout(const at::Tensor& param, const std::string& name,
                                    const dtensor::DeviceMesh& dp_mesh) {
  dtensor::Placements dp;
  if (dp_mesh.ndim() == 2) dp.push_back(dtensor::Replicate());
  dp.push_back(dtensor::Shard(0));
  const auto prior = nn::recorded_layout(param);
  if (!prior) return {dp_mesh, dp, param.sizes().vec()};
  auto mesh = dtensor::DeviceMesh::concatenate(prior->mesh, dp_mesh);
  TORCH_CHECK_VALUE(mesh.has_value(), "fully_shard: expected the data-parallel mesh ", dp_mesh.str(), " and ",
                    name, "'s tensor-parallel mesh ", prior->mesh.str(),
                    " to be slices of one mesh along distinct dims (e.g. mesh[\"dp\"] and mesh[\"tp\"] of "
                    "init_device_mesh), got unrelated meshes");
  auto placements = prior->placements;
  placements.insert(placements.end(), dp.begin(), dp.end());
  return {*mesh, placements, prior->global_shape};
}

}  // namespace

ParamGroup::ParamGroup(std::vector<at::Tensor> params, std::vector<std::string> names,
                       const FullyShardOptions& options) {
  auto mesh = options.mesh().value_or(dtensor::DeviceMesh::from_group(comm::world(), /*dim_name=*/"dp"));
  TORCH_CHECK_VALUE(
      mesh.ndim() == 1 || mesh.ndim() == 2,
      "fully_shard: expected a 1-d mesh (shard) or a 2-d mesh (replicate, shard) for HSDP, got a ",
      mesh.ndim(), "-d mesh ", mesh.str());
  TORCH_CHECK_VALUE(
      !options.offload_policy().pin_memory(),
      "fully_shard: expected OffloadPolicy pin_memory false: pinned host memory needs an "
      "accelerator, and this build runs on the CPU (its parameters are in host memory already)");
  TORCH_CHECK_VALUE(
      options.reduce_bucket_cap_bytes() >= 0,
      "fully_shard: expected reduce_bucket_cap_bytes >= 0 (0: one reduce-scatter per group), got ",
      options.reduce_bucket_cap_bytes());
  TORCH_CHECK_VALUE(params.size() == names.size(), "fully_shard: expected one name per parameter (",
                    params.size(), "), got ", names.size());
  impl_ = std::make_shared<Impl>(mesh);
  auto& s = *impl_;
  static int64_t groups_made = 0;  // every rank makes its groups in the same order
  s.serial = groups_made++;
  s.shard_group = mesh.get_group(mesh.ndim() - 1);
  if (mesh.ndim() == 2) s.replicate_group = mesh.get_group(0);
  s.reshard_after_forward = options.reshard_after_forward();
  s.reduce_dtype = options.mp_policy().reduce_dtype();
  s.to_main_grad = options.mp_policy().apply_grad_on_fp32_main_grad();
  s.bucket_cap_bytes = options.reduce_bucket_cap_bytes();
  // Everything is checked before any parameter changes.
  std::vector<std::vector<int64_t>> shapes;
  std::vector<nn::ParameterLayout> layouts;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    TORCH_CHECK_VALUE(p.dim() >= 1,
                      "fully_shard: expected parameters of at least one dim (sharded on dim 0), got ",
                      names[i], " of shape ", p.sizes());
    // A meta parameter (FSDP2's deferred initialization) is sharded as meta; the group gathers
    // once module.to_empty has made it a cpu one (adopt_parameter, prepare_gather).
    TORCH_CHECK_NOT_IMPLEMENTED(p.device().is_cpu() || p.device().is_meta(),
                                "fully_shard: expected parameters on cpu (or meta, materialized later), got ",
                                names[i], " on ", p.device());
    TORCH_CHECK_VALUE(
        i == 0 || p.scalar_type() == params[0].scalar_type() || options.mp_policy().param_dtype(),
        mixed_dtypes(names[0], params[0].scalar_type(), names[i], p.scalar_type()));
    TORCH_CHECK_VALUE(!is_managed(p), "fully_shard: expected a parameter no fully_shard manages yet, got ",
                      names[i],
                      " (managed by another group: apply fully_shard bottom-up, each parameter once)");
    shapes.push_back(p.sizes().vec());
    layouts.push_back(composed_layout(p, names[i], mesh));
  }
  s.policy_dtype = options.mp_policy().param_dtype();
  s.gather_dtype = s.policy_dtype.value_or(params.empty() ? at::kFloat : params[0].scalar_type());
  s.layout = detail::FlatLayout(shapes, s.shard_group.size(), s.shard_group.rank());
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK_VALUE(managed().try_insert(params[i], true),
                      "fully_shard: expected each parameter once in a group, got ", names[i], " twice");
    {
      at::NoGradGuard no_grad;
      params[i].set_data(s.layout.shard_of(params[i].detach(), static_cast<int64_t>(i)));
    }
    nn::record_layout(params[i], std::move(layouts[i]));
    s.buffers.push_back(at::empty(shapes[i], params[i].options().dtype(s.gather_dtype)));
    set_storage(s.buffers.back(), false);
  }
  s.params = std::move(params);
  s.names = std::move(names);
}

ParamGroup::~ParamGroup() = default;

std::vector<size_t> ParamGroup::Impl::all_params() const {
  std::vector<size_t> all(params.size());
  std::iota(all.begin(), all.end(), size_t{0});
  return all;
}

std::string ParamGroup::Impl::label() const {
  constexpr size_t kNamed = 3;
  std::string out;
  for (size_t i = 0; i < std::min(names.size(), kNamed); ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > kNamed) out += " and " + std::to_string(names.size() - kNamed) + " more";
  return out;
}

// FNV-1a over the group's place in its root and the parameters' names, sizes and wants.
int64_t ParamGroup::Impl::content_of(const std::vector<size_t>& indices) const {
  uint64_t h = 0xcbf29ce484222325ULL;
  auto add = [&h](const void* data, size_t bytes) {
    for (size_t b = 0; b < bytes; ++b)
      h = (h ^ static_cast<const unsigned char*>(data)[b]) * 0x100000001b3ULL;
  };
  add(&position, sizeof(position));
  add(&gather_dtype, sizeof(gather_dtype));
  for (const auto i : indices) {
    add(names[i].data(), names[i].size() + 1);
    const auto elements = layout.padded_elements(static_cast<int64_t>(i));
    add(&elements, sizeof(elements));
    const auto wanted = wants(i);
    add(&wanted, sizeof(wanted));
  }
  return static_cast<int64_t>(h);
}

// Reads the shards now; the all-gather travels until finish_gather (a group of one rank moves
// nothing and is gathered at once).
void ParamGroup::Impl::start_gather() {
  // Kept gathered (set_reshard_after_backward(false), an unshard() ahead) and changed since (an
  // optimizer step): gathered again from here, so that a prefetch still travels ahead. Not in a
  // backward, whose graph may read the buffers.
  if (unsharded && !in_backward() && shards_changed()) {
    ++stats.regathered;
    free_buffers();
  }
  if (unsharded || gather_in_flight) return;
  prepare_gather();
  auto flat =
      at::zeros({layout.flat_elements()}, buffers.empty() ? at::TensorOptions() : buffers[0].options());
  versions_at_gather.clear();
  read_at_gather.clear();
  for (size_t i = 0; i < params.size(); ++i) {
    read_at_gather.push_back(params[i].detach());
    layout.local(flat, static_cast<int64_t>(i)).copy_(read_at_gather.back().reshape({-1}));
    versions_at_gather.push_back(static_cast<int64_t>(params[i]._version()));
  }
  ++stats.gathers;
  if (shard_group.size() > 1) {
    try {
      gather_in_flight =
          comm::start_all_gather(flat, shard_group, comm::Agreement::kPerOp, content_of(all_params()));
    } catch (const comm::DisagreementError& e) {
      // Compared before any data moves: say what a gather's content stands for.
      TORCH_CHECK(false, "fully_shard: expected every rank to gather the group (", label(),
                  ") with the same parameters, sizes, requires_grad flags and gradient hooks, in the same "
                  "dtype and the same order of groups, got an error: ",
                  e.what_without_backtrace());
    }
    return;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    set_storage(buffers[i], true);
    buffers[i].variable_data().copy_(layout.full(flat, static_cast<int64_t>(i)));
  }
  unsharded = true;
}

// Waits for the gather in flight (started here if none was) and writes the parameters. A gather
// whose shards changed in place after it read them (an optimizer step between a prefetch and
// its use) is done again: every rank runs the same steps, so every rank does.
void ParamGroup::Impl::finish_gather() {
  if (unsharded && (in_backward() || !shards_changed())) return;  // otherwise start_gather gathers anew
  const bool ahead = gather_in_flight.has_value();
  start_gather();
  if (unsharded) return;
  auto all = gather_in_flight->wait();
  gather_in_flight.reset();
  if (shards_changed()) {
    ++stats.regathered;
    start_gather();
    all = gather_in_flight->wait();
    gather_in_flight.reset();
  } else if (ahead) {
    ++stats.prefetched;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    set_storage(buffers[i], true);
    // Written through a view with its own version counter: the autograd graph's saved views of
    // the buffer stay valid (this is the data they saved, gathered again).
    buffers[i].variable_data().copy_(layout.full(all, static_cast<int64_t>(i)));
  }
  unsharded = true;
}

// A row-sparse group's forward with no gather of it under way: only the rows of `ids` (an
// embedding's tokens) travel, into the buffer; the rows not asked for read NaN. It leaves the
// group not unsharded: an unshard() still gathers the whole parameter.
void ParamGroup::Impl::gather_rows(const at::Tensor& ids) {
  prepare_gather();
  const auto unique = std::get<0>(at::_unique(ids.reshape({-1}).to(at::kLong), /*sorted=*/true));
  const auto shard = params[0].detach().reshape({-1, row_sparse_cols}).to(gather_dtype);
  const auto rows =
      comm::gather_rows(shard, buffers[0].size(0), unique, shard_group, content_of(all_params()));
  ++stats.gathers;
  set_storage(buffers[0], true);
  auto full = buffers[0].variable_data().view({-1, row_sparse_cols});
  full.fill_(std::numeric_limits<double>::quiet_NaN());
  full.index_copy_(0, unique, rows);
}

void ParamGroup::Impl::prepare_gather() {
  TORCH_INTERNAL_ASSERT(
      !unsharded && !gather_in_flight,
      "fully_shard: a gather prepared while the group is gathered or a gather is in flight");
  if (const auto problem = piece_problem(); !problem.empty()) fail_on_every_rank(problem);
  if (!buffers_stale()) return;
  // The shards were cast (module.to(dtype) after fully_shard) or materialized (to_empty): gather
  // in their dtype, on their device. A graph made before keeps views of the old buffers, which
  // its pre-backward refuses (check_not_converted_since); the views kept for a recomputation go.
  if (!policy_dtype) gather_dtype = params[0].scalar_type();
  for (size_t i = 0; i < buffers.size(); ++i) {
    buffers[i] = at::empty(buffers[i].sizes(), params[i].options().dtype(gather_dtype));
    set_storage(buffers[i], false);
  }
  grad_views.clear();
  gathered.clear();
  ++generation;
}

std::string ParamGroup::Impl::piece_problem() const {
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    if (p.is_meta()) {
      return c10::str("fully_shard: expected ", names[i],
                      " on cpu when its group gathers, got it on meta (materialize the module passed to "
                      "fully_shard: module.to_empty(device=\"cpu\"), then initialize it)");
    }
    const auto piece = layout.local_shape(static_cast<int64_t>(i));
    if (!p.device().is_cpu() || p.sizes() != at::IntArrayRef(piece)) {
      return c10::str("fully_shard: expected ", names[i], " to stay this rank's piece of it (shape ",
                      at::IntArrayRef(piece), " on cpu), got shape ", p.sizes(), " on ", p.device(),
                      " (its .data replaced, or the parameter assigned anew, by another tensor)");
    }
    if (!policy_dtype && p.scalar_type() != params[0].scalar_type()) {
      return mixed_dtypes(names[0], params[0].scalar_type(), names[i], p.scalar_type()) +
             " (a cast of part of the group)";
    }
  }
  return {};
}

void ParamGroup::Impl::fail_on_every_rank(const std::string& problem) {
  if (shard_group.size() > 1) {
    const auto flat = at::zeros({layout.flat_elements()}, at::TensorOptions().dtype(gather_dtype));
    try {
      // Ranks that can gather disagree with this content before any data moves; if every rank
      // fails alike, the gather of zeros completes.
      comm::start_all_gather(flat, shard_group, comm::Agreement::kPerOp, ~content_of(all_params())).wait();
    } catch (const comm::DisagreementError&) {
    }
  }
  TORCH_CHECK_VALUE(false, problem);
}

void ParamGroup::Impl::free_buffers() {
  if (gather_in_flight) {  // its transfers write into its own buffer: wait, then drop it
    gather_in_flight->wait();
    gather_in_flight.reset();
  }
  for (auto& b : buffers) set_storage(b, false);
  read_at_gather.clear();  // the pieces a gather read: not kept alive past it
  unsharded = false;
}

void ParamGroup::unshard(bool async_op) {
  if (async_op) {
    impl_->start_gather();
  } else {
    impl_->finish_gather();
  }
}
void ParamGroup::wait_for_unshard() { impl_->finish_gather(); }
void ParamGroup::share_pass_order(const std::vector<ParamGroup*>& groups) {
  auto order = std::make_shared<detail::PassOrder>();
  for (size_t i = 0; i < groups.size(); ++i) {
    if (groups[i] == nullptr) continue;
    groups[i]->impl_->order = order;
    groups[i]->impl_->position = static_cast<int64_t>(i);
  }
}
GatherStats ParamGroup::gather_stats() const { return impl_->stats; }
void ParamGroup::reshard() { impl_->free_buffers(); }
bool ParamGroup::is_unsharded() const { return impl_->unsharded; }
void ParamGroup::set_users(int64_t users) {
  TORCH_CHECK_VALUE(users >= 1, "ParamGroup::set_users: expected users >= 1, got ", users);
  impl_->users = users;
}
void ParamGroup::set_requires_gradient_sync(bool sync) { impl_->sync = sync; }

void ParamGroup::set_requires_all_reduce(bool all_reduce) { impl_->all_reduce = all_reduce; }

void ParamGroup::set_reduce_op(comm::ReduceOp op) {
  auto& s = *impl_;
  // Reduce-scattered sums held for the all-reduce were combined with the old op.
  TORCH_CHECK_VALUE(
      op == s.reduce_op || !s.holds_partial_sums(), "fully_shard: expected the reduce op of ", s.label(),
      " set before the micro-batches whose reduce-scattered sums it holds, got a change from ",
      comm::to_string(s.reduce_op), " to ", comm::to_string(op),
      " while it holds some (set_requires_all_reduce(false)); change it after the backward with "
      "the all-reduce");
  s.reduce_op = op;
}
void ParamGroup::set_reshard_after_forward(bool reshard) { impl_->reshard_after_forward = reshard; }
void ParamGroup::set_reshard_after_backward(bool reshard) { impl_->reshard_after_backward = reshard; }
void ParamGroup::set_gradient_scaling_factor(double factor) { impl_->scale = factor; }

void ParamGroup::check_gradient_divide_factor(double factor) {
  TORCH_CHECK_VALUE(factor > 0 && std::isfinite(factor),
                    "set_gradient_divide_factor: expected a finite number > 0, got ", factor);
}

void ParamGroup::set_gradient_divide_factor(double factor) {
  check_gradient_divide_factor(factor);
  set_reduce_op(comm::ReduceOp::kSum);
  impl_->scale = 1.0 / factor;
}

void ParamGroup::set_row_sparse_gradients(bool row_sparse) {
  auto& s = *impl_;
  if (!row_sparse) {
    s.row_sparse_cols = 0;
    s.rows_by_id = false;
    return;
  }
  TORCH_CHECK_VALUE(s.params.size() == 1 && s.buffers[0].dim() >= 2,
                    "ParamGroup::set_row_sparse_gradients: expected a group of one parameter of at least 2 "
                    "dims (an embedding's weight), got ",
                    s.params.size(), " parameters", s.params.empty() ? "" : ", the first of shape ",
                    s.params.empty() ? at::IntArrayRef() : s.buffers[0].sizes());
  // The flat buffer of a one-parameter group is its padded row blocks: whole rows per rank.
  s.row_sparse_cols = s.buffers[0].numel() / std::max<int64_t>(s.buffers[0].size(0), 1);
  // Ids index the table's rows unless a tensor-parallel style cut its rows (the vocabulary) over
  // more than one rank: that style's forward maps them to its own rows.
  const auto layout = nn::recorded_layout(s.params[0]);
  const int64_t tp_dims = layout ? layout->mesh.ndim() - s.mesh.ndim() : 0;
  s.rows_by_id = true;
  for (int64_t d = 0; d < tp_dims; ++d) {
    if (layout->placements[d].is_shard(0) && layout->mesh.size(d) > 1) s.rows_by_id = false;
  }
}
const std::vector<at::Tensor>& ParamGroup::parameters() const { return impl_->params; }
const std::vector<at::Tensor>& ParamGroup::gathered() const { return impl_->gathered; }
const dtensor::DeviceMesh& ParamGroup::mesh() const { return impl_->mesh; }

int64_t ParamGroup::index_of(const at::Tensor& param) const {
  for (size_t i = 0; i < impl_->params.size(); ++i) {
    if (impl_->params[i].unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) return static_cast<int64_t>(i);
  }
  return -1;
}

void ParamGroup::adopt_parameter(int64_t i, const at::Tensor& param) {
  auto& s = *impl_;
  TORCH_CHECK_VALUE(i >= 0 && i < static_cast<int64_t>(s.params.size()),
                    "ParamGroup::adopt_parameter: expected an index in [0, ", s.params.size(), "), got ", i);
  if (param.unsafeGetTensorImpl() == s.params[i].unsafeGetTensorImpl()) return;
  TORCH_CHECK_VALUE(!s.unsharded && !s.gather_in_flight, "fully_shard: expected ", s.names[i],
                    " replaced while its group is resharded, got the group gathered (a conversion "
                    "inside a forward or backward, or after unshard(): reshard() first)");
  TORCH_CHECK_VALUE(managed().try_insert(param, true), "fully_shard: expected ", s.names[i],
                    " replaced by a tensor no fully_shard manages, got a managed one");
  if (auto layout = nn::recorded_layout(s.params[i])) nn::record_layout(param, std::move(*layout));
  s.params[i] = param;  // its shape is checked, on every rank, by the next gather
  ++s.generation;
}

bool ParamGroup::is_managed(const at::Tensor& param) { return managed().find(param).has_value(); }

}  // namespace hyper_parallel::fully_shard
