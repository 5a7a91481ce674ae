#pragma once
// data_parallel: a module's replicas over the data-parallel dimension of a mesh. Each replica
// runs its share of the batch; the gradients are averaged over the dimension during the
// backward (GradientReducer). Parameters already sharded over a tensor-parallel dimension are
// averaged shard by shard, each over the ranks that hold that shard.
//
// Usage (2-D mesh: tensor parallel inside, data parallel across):
//   auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
//   parallelize_module(*model, mesh["tp"], plan);
//   auto reducer = data_parallel(*model, mesh["dp"]);
//   loss.backward();    // gradients averaged over dp when it returns
//   optimizer.step();

#include <memory>

#include <torch/nn/module.h>

#include <hyper_parallel/core/data_parallel/gradient_reducer.h>
#include <hyper_parallel/core/data_parallel/replica_sync.h>
#include <hyper_parallel/core/dtensor/device_mesh.h>

namespace hyper_parallel::data_parallel {

/// Averages `module`'s gradients over `mesh` (1-D: the dp dimension). Parallelize the module
/// over its other dimensions first: the buckets are laid out from the parameters' shapes now.
/// The weights of its Embedding modules (hyper_parallel::nn's and torch::nn's) that require grad
/// join options.row_sparse_parameters (unless options.row_sparse_embeddings is false): only the
/// rows of the tokens a step saw travel.
/// It then gives every rank group rank 0's parameters and buffers (ReplicaSync), as DDP does: the
/// replicas start equal. A forward that updates buffers (batch norm's running statistics) leaves
/// them apart; DDP's broadcast_buffers is a ReplicaSync over module.buffers() called before each
/// training forward (the Python front end installs it as a forward pre-hook).
/// The reducer stays active while the returned pointer lives (dropping it turns data parallelism
/// off: hence [[nodiscard]]).
[[nodiscard]] std::shared_ptr<GradientReducer> data_parallel(torch::nn::Module& module,
                                                             const dtensor::DeviceMesh& mesh,
                                                             GradientReducerOptions options = {});
/// The same over a list of parameters (a torch.nn module's, from Python), in their order, without
/// the ReplicaSync: the caller makes the replicas equal. `names[i]` names params[i] in errors.
/// Every parameter must be replicated over the mesh: one sharded over two or more of its ranks
/// (fully_shard's, over the same mesh dim) is a c10::ValueError.
[[nodiscard]] std::shared_ptr<GradientReducer> data_parallel(const std::vector<at::Tensor>& params,
                                                             const dtensor::DeviceMesh& mesh,
                                                             const GradientReducerOptions& options = {},
                                                             const std::vector<std::string>& names = {});

}  // namespace hyper_parallel::data_parallel
