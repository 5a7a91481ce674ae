#include <hyper_parallel/core/data_parallel/data_parallel.h>

#include <algorithm>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/nn/modules/embedding.h>

#include <hyper_parallel/core/data_parallel/replica_sync.h>
#include <hyper_parallel/core/nn/embedding.h>

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

}  // namespace

std::shared_ptr<GradientReducer> data_parallel(const std::vector<at::Tensor>& params,
                                               const dtensor::DeviceMesh& mesh,
                                               const GradientReducerOptions& options) {
  TORCH_CHECK_VALUE(mesh.ndim() == 1,
                    "data_parallel: expected a 1-D mesh (the data-parallel dimension, e.g. ",
                    "mesh[\"dp\"]), got a ", mesh.ndim(), "-D mesh");
  return std::make_shared<GradientReducer>(params, mesh.get_group(0), options);
}

std::shared_ptr<GradientReducer> data_parallel(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                                               GradientReducerOptions options) {
  auto reducer = data_parallel(module.parameters(), mesh,
                               options.row_sparse_parameters(row_sparse_weights(module, options)));
  std::vector<at::Tensor> states;
  std::vector<std::string> names;
  for (const auto& item : module.named_parameters()) {
    states.push_back(item.value());
    names.push_back("parameter " + item.key());
  }
  for (const auto& item : module.named_buffers()) {
    states.push_back(item.value());
    names.push_back("buffer " + item.key());
  }
  ReplicaSync(states, mesh, names)();
  return reducer;
}

}  // namespace hyper_parallel::data_parallel
