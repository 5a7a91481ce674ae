#include <hyper_parallel/core/dtensor/dtensor.h>

#include <functional>
#include <numeric>
#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>

#include <hyper_parallel/core/comm/collectives.h>

#include "../autograd/attach_backward.h"
#include "../autograd/unobserved.h"
#include "../autograd/weight_grad_scheduler.h"
#include "grad_slot.h"

namespace hyper_parallel::dtensor {

namespace {

using comm::ReduceOp;

Placements normalized(const Placements& placements, int64_t ndim) {
  Placements out;
  for (const auto& p : placements) out.push_back(p.normalized(ndim));
  return out;
}

Placements for_gradient(const Placements& placements) {
  Placements out;
  for (const auto& p : placements) out.push_back(p.for_gradient());
  return out;
}

void check_placements(const char* fn, const DeviceMesh& mesh, const Placements& placements, int64_t ndim) {
  TORCH_CHECK(static_cast<int64_t>(placements.size()) == mesh.ndim(), fn,
              ": expected one placement per mesh dim (", mesh.ndim(), "), got ", to_string(placements));
  for (const auto& p : placements) {
    if (p.is_shard()) {
      TORCH_CHECK(p.dim() >= -ndim && p.dim() < ndim, fn, ": expected Shard dim in [", -ndim, ", ", ndim,
                  ") for a ", ndim, "-d tensor, got ", p.str());
    }
  }
}

// Extent along tensor dim d of the shard held by the rank whose coordinate is `coord`, under
// `placements` (nested in mesh-dim order).
int64_t shard_extent(const DeviceMesh& mesh, std::vector<int64_t> coord, int64_t global,
                     const Placements& placements, int64_t d) {
  int64_t extent = global;
  for (int64_t i = 0; i < mesh.ndim(); ++i) {
    if (placements[i].is_shard(d)) extent = shard_size(extent, mesh.size(i), coord[i]);
  }
  return extent;
}

// Extents along d of every rank of mesh dim i's group (they differ only in coordinate i).
std::vector<int64_t> group_extents(const DeviceMesh& mesh, int64_t global, const Placements& placements,
                                   int64_t d, int64_t i) {
  std::vector<int64_t> sizes;
  auto coord = mesh.coordinate();
  for (int64_t k = 0; k < mesh.size(i); ++k) {
    coord[i] = k;
    sizes.push_back(shard_extent(mesh, coord, global, placements, d));
  }
  return sizes;
}

// Mesh dim i shards tensor dim d in `cur`; must it be gathered before reaching `to`? Yes if its
// own placement changes, or if any outer mesh dim (j < i) changes whether it shards d: the
// nesting order of chunks would no longer match.
bool must_unshard(const Placements& cur, const Placements& to, int64_t i) {
  const int64_t d = cur[i].dim();
  if (to[i] != cur[i]) return true;
  for (int64_t j = 0; j < i; ++j) {
    if (cur[j].is_shard(d) != to[j].is_shard(d)) return true;
  }
  return false;
}

// Shard(d) -> Shard(e) on mesh dim i is one all_to_all when no other mesh dim shards d or e.
bool all_to_all_eligible(const Placements& cur, const Placements& to, int64_t i) {
  if (!cur[i].is_shard() || !to[i].is_shard() || cur[i] == to[i]) return false;
  const int64_t d = cur[i].dim(), e = to[i].dim();
  for (size_t j = 0; j < cur.size(); ++j) {
    if (static_cast<int64_t>(j) == i) continue;
    for (const auto* p : {&cur[j], &to[j]}) {
      if (p->is_shard(d) || p->is_shard(e)) return false;
    }
  }
  return true;
}

// redistribute_local whose gathers run `while_in_flight` while their last blocks travel.
at::Tensor redistribute_with_window(const at::Tensor& local, const DeviceMesh& mesh,
                                    const std::vector<int64_t>& global_shape, const Placements& from,
                                    const Placements& to, const comm::InFlightFn& while_in_flight) {
  const auto ndim = static_cast<int64_t>(global_shape.size());
  check_placements("redistribute", mesh, from, ndim);
  check_placements("redistribute", mesh, to, ndim);
  Placements cur = normalized(from, ndim);
  const Placements target = normalized(to, ndim);
  at::Tensor x = local;
  const auto& coord = mesh.coordinate();

  // Phase 1, innermost mesh dim first: gather every shard that cannot stay.
  for (int64_t i = mesh.ndim() - 1; i >= 0; --i) {
    if (!cur[i].is_shard() || all_to_all_eligible(cur, target, i) || !must_unshard(cur, target, i)) {
      continue;
    }
    const int64_t d = cur[i].dim();
    auto sizes = group_extents(mesh, global_shape[d], cur, d, i);
    x = comm::all_gather(x, d, mesh.get_group(i), sizes, while_in_flight);
    cur[i] = Replicate();
  }
  // Phase 2, outermost first (so nested shards are cut in mesh-dim order).
  for (int64_t i = 0; i < mesh.ndim(); ++i) {
    const Placement& c = cur[i];
    const Placement& t = target[i];
    if (c == t) continue;
    const auto group = mesh.get_group(i);
    const int64_t n = mesh.size(i), k = coord[i];
    if (c.is_replicate() && t.is_shard()) {
      const int64_t d = t.dim(), extent = x.size(d);
      x = x.narrow(d, shard_offset(extent, n, k), shard_size(extent, n, k)).contiguous();
    } else if (c.is_replicate() && t.is_partial()) {
      // Sum: one rank keeps the value; mean: all keep it.
      if (t.reduce_op() == ReduceOp::kSum && k != 0) x = at::zeros_like(x);
    } else if (c.is_partial() && t.is_replicate()) {
      x = comm::all_reduce(x, c.reduce_op(), group);
    } else if (c.is_partial() && t.is_shard()) {
      x = comm::reduce_scatter(x, t.dim(), c.reduce_op(), group);
    } else if (c.is_partial() && t.is_partial()) {
      // Partial(sum) of locals L equals Partial(avg) of n*L.
      x = c.reduce_op() == ReduceOp::kSum ? x * n : x / n;
    } else if (c.is_shard() && t.is_shard()) {
      const int64_t d = c.dim(), e = t.dim();
      auto recv_sizes = group_extents(mesh, global_shape[d], cur, d, i);
      x = comm::all_to_all(x, /*split_dim=*/e, /*concat_dim=*/d, group, comm::chunk_sizes(x.size(e), n),
                           recv_sizes);
    } else {
      TORCH_INTERNAL_ASSERT(false, "redistribute: unhandled ", c.str(), " -> ", t.str());
    }
    cur[i] = t;
  }
  return x;
}

// Whether some mesh dim goes Partial -> Shard: a reduce-scatter, whose backward gathers.
bool backward_gathers(const Placements& from, const Placements& to) {
  for (size_t i = 0; i < from.size(); ++i) {
    if (from[i].is_partial() && to[i].is_shard()) return true;
  }
  return false;
}

// from_local's run_check: every rank's local extents, gathered over the whole mesh (innermost dim
// first, each gather carrying the table so far), so that every rank reaches the same verdict. The
// global shape they imply must split into them as torch.chunk does (and be `requested`, if given).
std::vector<int64_t> checked_global_shape(const at::Tensor& local, const DeviceMesh& mesh,
                                          const Placements& pl,
                                          const std::optional<std::vector<int64_t>>& requested) {
  const int64_t ndim = local.dim();
  auto table = at::tensor(local.sizes().vec(), at::kLong).reshape({1, ndim});
  for (int64_t i = mesh.ndim() - 1; i >= 0; --i)
    table = comm::all_gather(table.unsqueeze(0), 0, mesh.get_group(i));
  table = table.reshape({mesh.size(), ndim});  // one row per rank, by row-major mesh coordinate
  std::vector<int64_t> shape(ndim);
  for (int64_t d = 0; d < ndim; ++d) {
    int64_t copies = 1;  // how many ranks hold each element of dim d
    for (int64_t i = 0; i < mesh.ndim(); ++i) copies *= pl[i].is_shard(d) ? 1 : mesh.size(i);
    shape[d] = table.select(1, d).sum().item<int64_t>() / copies;
  }
  std::vector<int64_t> coordinate(mesh.ndim());
  for (int64_t flat = 0; flat < mesh.size(); ++flat) {
    for (int64_t i = mesh.ndim() - 1, rest = flat; i >= 0; rest /= mesh.size(i), --i)
      coordinate[i] = rest % mesh.size(i);
    const auto expected = local_shape(shape, mesh.shape(), coordinate, pl);
    const auto row = table[flat];
    const std::vector<int64_t> got(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + ndim);
    TORCH_CHECK_VALUE(got == expected, "DTensor::from_local: expected local shape ",
                      c10::IntArrayRef(expected), " on mesh coordinate ", c10::IntArrayRef(coordinate),
                      " (torch.chunk's split of the global shape ", c10::IntArrayRef(shape),
                      " the ranks' shards add up to, placements ", to_string(pl), "), got ",
                      c10::IntArrayRef(got));
  }
  TORCH_CHECK_VALUE(!requested || *requested == shape, "DTensor::from_local: expected the shape given (",
                    c10::IntArrayRef(requested ? *requested : shape),
                    ") to be the one the ranks' shards make, got ", c10::IntArrayRef(shape));
  return shape;
}

// run_check's data: each Replicate mesh dim's replicas take those of coordinate 0, as torch's.
at::Tensor replicas_of_coordinate_0(const at::Tensor& local, const DeviceMesh& mesh, const Placements& pl) {
  at::Tensor x = local.detach();
  for (int64_t i = 0; i < mesh.ndim(); ++i) {
    if (pl[i].is_replicate() && mesh.size(i) > 1) x = comm::broadcast(x.contiguous(), 0, mesh.get_group(i));
  }
  return x;
}

}  // namespace

at::Tensor redistribute_local(const at::Tensor& local, const DeviceMesh& mesh,
                              const std::vector<int64_t>& global_shape, const Placements& from,
                              const Placements& to) {
  return redistribute_with_window(local, mesh, global_shape, from, to, {});
}

DTensor::DTensor(at::Tensor local, DeviceMesh mesh, Placements placements, std::vector<int64_t> shape)
    : local_(std::move(local)),
      mesh_(std::move(mesh)),
      placements_(std::move(placements)),
      shape_(std::move(shape)),
      grad_slot_(std::make_shared<GradSlot>()) {}

DTensor DTensor::from_local(const at::Tensor& local, const DeviceMesh& mesh, const Placements& placements,
                            const FromLocalOptions& options) {
  TORCH_CHECK(local.defined(), "DTensor::from_local: expected a defined tensor, got undefined");
  const int64_t ndim = local.dim();
  check_placements("DTensor::from_local", mesh, placements, ndim);
  Placements pl = normalized(placements, ndim);
  std::vector<int64_t> shape;
  if (options.run_check()) {
    shape = checked_global_shape(local, mesh, pl, options.shape());
  } else if (options.shape()) {
    shape = *options.shape();
    TORCH_CHECK(static_cast<int64_t>(shape.size()) == ndim, "DTensor::from_local: expected a shape of ", ndim,
                " dims, got ", c10::IntArrayRef(shape));
    auto expected = local_shape(shape, mesh.shape(), mesh.coordinate(), pl);
    TORCH_CHECK(local.sizes() == c10::IntArrayRef(expected), "DTensor::from_local: expected local shape ",
                c10::IntArrayRef(expected), " for global shape ", c10::IntArrayRef(shape), " and placements ",
                to_string(pl), ", got ", local.sizes());
  } else {
    shape = local.sizes().vec();
    for (int64_t i = 0; i < mesh.ndim(); ++i) {
      if (pl[i].is_shard()) shape[pl[i].dim()] *= mesh.size(i);
    }
  }
  auto slot = std::make_shared<GradSlot>();
  // The gradient comes back with the consumers' placements; bring it to ours.
  auto out = attach_producer_backward(
      local, options.run_check() ? replicas_of_coordinate_0(local, mesh, pl) : local.detach(), slot,
      for_gradient(pl),
      [mesh, shape, pl](const at::Tensor& grad, const Placements& from) {
        return redistribute_local(grad, mesh, shape, from, for_gradient(pl));
      },
      kFromLocalBackward);
  DTensor result(out, mesh, pl, shape);
  result.grad_slot_ = slot;
  return result;
}

at::Tensor DTensor::to_local(const Placements& grad_placements) const {
  check_placements("DTensor::to_local", mesh_, grad_placements, dim());
  auto pl = normalized(grad_placements, dim());
  const auto own = for_gradient(placements_);
  if (pl == own || !local_.requires_grad()) return local_;
  // This consumer's gradient goes to the producer apart from autograd's sum (GradSlot), when the
  // producer's node is the very next (no in-place op on the local tensor since) and runs with no
  // reader of its input gradient; otherwise it is converted here, on its own.
  std::weak_ptr<torch::autograd::Node> producer;
  if (local_.grad_fn() && local_.grad_fn() == grad_slot_->producer.lock()) producer = local_.grad_fn();
  return detail::attach_backward(
      {local_}, {local_.detach()},
      [slot = grad_slot_, pl, own, producer, mesh = mesh_, shape = shape_](std::vector<at::Tensor> grads) {
        if (!grads[0].defined()) return std::vector<at::Tensor>{at::Tensor()};
        auto node = producer.lock();
        if (node && detail::runs_unobserved(*node)) {
          slot->add(pl, grads[0]);
          return std::vector<at::Tensor>{at::Tensor()};
        }
        return std::vector<at::Tensor>{redistribute_local(grads[0], mesh, shape, pl, own)};
      },
      "DTensorToLocalBackward", /*materialize_grads=*/false)[0];
}

DTensor DTensor::redistribute(const Placements& placements) const {
  check_placements("DTensor::redistribute", mesh_, placements, dim());
  Placements target = normalized(placements, dim());
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = redistribute_local(local_, mesh_, shape_, placements_, target);
  }
  auto slot = std::make_shared<GradSlot>();
  out = attach_producer_backward(
      local_, out, slot, for_gradient(target),
      [mesh = mesh_, shape = shape_, from = placements_](const at::Tensor& grad, const Placements& grad_pl) {
        // The work deferred into this gather's window (autograd/weight_grad_scheduler.h) runs while its
        // last blocks travel.
        return redistribute_with_window(grad, mesh, shape, grad_pl, for_gradient(from), [] {
          hyper_parallel::detail::WeightGradScheduler::of_this_thread().run_posted();
        });
      },
      "DTensorRedistributeBackward");
  // A reduce-scatter (a row-parallel output, the embedding's) gathers in backward: it hosts the
  // deferred work of the ops recorded after it.
  if (backward_gathers(placements_, target))
    hyper_parallel::detail::WeightGradScheduler::of_this_thread().remember_host(out);
  DTensor result(out, mesh_, target, shape_);
  result.grad_slot_ = slot;
  return result;
}

DTensor DTensor::redistribute(const DeviceMesh& mesh, const Placements& placements) const {
  TORCH_CHECK_NOT_IMPLEMENTED(mesh == mesh_, "DTensor::redistribute: expected this DTensor's mesh ",
                              mesh_.str(), ", got ", mesh.str(),
                              " (moving to another mesh is not supported; a mesh made apart is another, "
                              "even over the same ranks)");
  return redistribute(placements);
}

DTensor DTensor::reduce_partial() const {
  Placements target = placements_;
  for (auto& p : target) {
    if (p.is_partial()) p = Replicate();
  }
  return target == placements_ ? *this : redistribute(target);
}

DTensor DTensor::with_local(const at::Tensor& local) const {
  TORCH_CHECK_VALUE(local.defined() && local.sizes() == local_.sizes(),
                    "DTensor::with_local: expected a local tensor of shape ", local_.sizes(), ", got ",
                    local.defined() ? local.sizes() : c10::IntArrayRef{});
  return from_local(local, mesh_, placements_, FromLocalOptions().shape(shape_));
}

const DTensor& DTensor::copy_(const DTensor& src) const {
  TORCH_CHECK_VALUE(src.mesh_ == mesh_, "DTensor::copy_: expected a source on this DTensor's mesh ",
                    mesh_.str(), ", got ", src.mesh_.str());
  const bool scalar = src.numel() == 1 && src.placements_ == Placements(mesh_.ndim(), Replicate());
  TORCH_CHECK_VALUE(src.shape_ == shape_ || scalar, "DTensor::copy_: expected a source of global shape ",
                    c10::IntArrayRef(shape_), " or one replicated element, got one of global shape ",
                    c10::IntArrayRef(src.shape_), " and placements ", to_string(src.placements_));
  // Laid out otherwise (a Partial sum, other shards): moved to this DTensor's placements first
  // (a Partial target: one rank keeps the value).
  DTensor source = src;
  if (src.shape_ != shape_) {  // one replicated element: broadcast (a view) to this global shape
    source = from_local(src.local_.reshape({}).expand(shape_), mesh_, src.placements_,
                        FromLocalOptions().shape(shape_));
  }
  local_.copy_(source.placements_ == placements_ ? source.local_ : source.redistribute(placements_).local_);
  return *this;
}

int64_t DTensor::numel() const {
  return std::accumulate(shape_.begin(), shape_.end(), int64_t{1}, std::multiplies<>());
}

at::Tensor DTensor::full_tensor() const {
  return redistribute(Placements(mesh_.ndim(), Replicate())).to_local();
}

std::string DTensor::str() const {
  std::ostringstream s;
  s << "DTensor(shape=" << c10::IntArrayRef(shape_) << ", placements=" << to_string(placements_)
    << ", local=" << local_.sizes() << ", dtype=" << local_.scalar_type() << ")";
  return s.str();
}

DTensor distribute_tensor(const at::Tensor& tensor, const DeviceMesh& mesh, const Placements& placements,
                          std::optional<int64_t> src_data_rank) {
  TORCH_CHECK(tensor.defined(), "distribute_tensor: expected a defined tensor, got undefined");
  const int64_t ndim = tensor.dim();
  check_placements("distribute_tensor", mesh, placements, ndim);
  for (const auto& p : placements) {
    TORCH_CHECK(!p.is_partial(), "distribute_tensor: does not support Partial placements, got ",
                to_string(placements));
  }
  Placements pl = normalized(placements, ndim);
  const auto shape = tensor.sizes().vec();
  at::Tensor local;
  {
    at::NoGradGuard no_grad;
    at::Tensor full = tensor;
    // A meta tensor (deferred initialization) has no values to agree on: each rank initializes
    // its piece later.
    if (src_data_rank && !tensor.is_meta()) {
      // The source is the rank at coordinate src_data_rank on every mesh dim. Broadcast along
      // mesh dim 0 on the plane whose later coordinates are the source's, then along dim 1 from
      // those ranks, and so on: each rank receives once.
      for (int64_t i = 0; i < mesh.ndim(); ++i) {
        TORCH_CHECK(*src_data_rank >= 0 && *src_data_rank < mesh.size(i),
                    "distribute_tensor: expected src_data_rank (the source's coordinate on every "
                    "mesh dim) in [0, ",
                    mesh.size(i), ") for mesh dim ", i, " of ", mesh.str(), ", got ", *src_data_rank);
      }
      const auto& coord = mesh.coordinate();
      for (int64_t i = 0; i < mesh.ndim(); ++i) {
        bool on_source_plane = true;  // coordinates after i match the source's
        for (int64_t j = i + 1; j < mesh.ndim(); ++j) on_source_plane &= coord[j] == *src_data_rank;
        if (on_source_plane) full = comm::broadcast(full, *src_data_rank, mesh.get_group(i));
      }
    }
    local = redistribute_local(full, mesh, shape, Placements(mesh.ndim(), Replicate()), pl);
    if (local.is_same(tensor) || local.is_alias_of(tensor)) local = local.clone();
  }
  auto slot = std::make_shared<DTensor::GradSlot>();
  local = attach_producer_backward(
      tensor, local, slot, pl,
      [mesh, shape](const at::Tensor& grad, const Placements& grad_pl) {
        return redistribute_local(grad, mesh, shape, grad_pl, Placements(mesh.ndim(), Replicate()));
      },
      "DistributeTensorBackward");
  DTensor result(local, mesh, pl, shape);
  result.grad_slot_ = slot;
  return result;
}

}  // namespace hyper_parallel::dtensor
