#include <hyper_parallel/core/data_parallel/data_parallel.h>

#include <algorithm>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/nn/modules/embedding.h>

#include <hyper_parallel/core/data_parallel/replica_sync.h>
#include <hyper_parallel/core/nn/embedding.h>
#include <hyper_parallel/core/nn/parameter_layout.h>

namespace hyper_parallel::data_parallel {

namespace {

// options.row_sparse_parameters, and the weights of `module`'s Embedding modules that require
// grad unless options.row_sparse_embeddings is false.
std::vector<at::Tensor> row_sparse_weights(torch::nn::Module& module, const GradientReducerOptions& options) {
  auto row_sparse = options.row_sparse_parameters();
  if (!options.row_sparse_embeddings()) return row_sparse;
  std::vector<torch::nn::Module*> modules{&module};  // not modules(): the module may be on the stack
  for (const auto& m : module.modules(/*include_self=*/false)) modules.push_back(m.get());
  for (auto* m : modules) {
    at::Tensor weight;
    if (auto* e = dynamic_cast<nn::EmbeddingImpl*>(m)) weight = e->weight;
    if (auto* e = dynamic_cast<torch::nn::EmbeddingImpl*>(m)) weight = e->weight;
    const bool listed = std::any_of(row_sparse.begin(), row_sparse.end(), [&](const at::Tensor& t) {
      return t.unsafeGetTensorImpl() == weight.unsafeGetTensorImpl();
    });
    if (weight.defined() && weight.requires_grad() && !listed) row_sparse.push_back(weight);
  }
  return row_sparse;
}

// A parameter sharded over two or more ranks of the data-parallel group (by fully_shard, over
// the same mesh dim) holds different rows on them: averaging its gradient or syncing it would mix
// them, and fully_shard already reduces its gradient. Local: every rank sees the same layouts.
void check_replicated_over(const std::vector<at::Tensor>& params, const std::vector<std::string>& names,
                           const comm::Group& group) {
  const auto& replicas = group.global_ranks();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto layout = nn::recorded_layout(params[i]);
    for (size_t d = 0; layout && d < layout->placements.size(); ++d) {
      if (!layout->placements[d].is_shard()) continue;
      const auto& line = layout->mesh.get_group(static_cast<int64_t>(d)).global_ranks();
      const auto shared = std::count_if(line.begin(), line.end(), [&](int64_t r) {
        return std::find(replicas.begin(), replicas.end(), r) != replicas.end();
      });
      TORCH_CHECK_VALUE(
          shared < 2, "data_parallel: expected parameters replicated over the data-parallel group, got ",
          i < names.size() ? names[i] : "parameter " + std::to_string(i), " sharded over ", shared,
          " of its ranks (mesh dim ", d, " of ", layout->mesh.str(),
          ", e.g. by fully_shard, which reduces its gradient itself); apply data_parallel to a module "
          "holding only parameters fully_shard leaves out (its ignored_params), or over another mesh dim");
    }
  }
}

}  // namespace

std::shared_ptr<GradientReducer> data_parallel(const std::vector<at::Tensor>& params,
                                               const dtensor::DeviceMesh& mesh,
                                               const GradientReducerOptions& options,
                                               const std::vector<std::string>& names) {
  TORCH_CHECK_VALUE(mesh.ndim() == 1,
                    "data_parallel: expected a 1-D mesh (the data-parallel dimension, e.g. ",
                    "mesh[\"dp\"]), got a ", mesh.ndim(), "-D mesh");
  check_replicated_over(params, names, mesh.get_group(0));
  return std::make_shared<GradientReducer>(params, mesh.get_group(0), options);
}

std::shared_ptr<GradientReducer> data_parallel(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                                               GradientReducerOptions options) {
  std::vector<at::Tensor> states;
  std::vector<std::string> names;
  for (const auto& item : module.named_parameters()) {
    states.push_back(item.value());
    names.push_back("parameter " + item.key());
  }
  auto reducer =
      data_parallel(states, mesh, options.row_sparse_parameters(row_sparse_weights(module, options)), names);
  for (const auto& item : module.named_buffers()) {
    states.push_back(item.value());
    names.push_back("buffer " + item.key());
  }
  ReplicaSync(states, mesh, names)();
  return reducer;
}

}  // namespace hyper_parallel::data_parallel
