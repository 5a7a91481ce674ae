#include <hyper_parallel/core/data_parallel/data_parallel.h>

#include <algorithm>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/nn/modules/embedding.h>

#include <hyper_parallel/core/nn/embedding.h>

namespace hyper_parallel::data_parallel {

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
  auto row_sparse = options.row_sparse_parameters();
  if (!options.row_sparse_embeddings()) return data_parallel(module.parameters(), mesh, options);
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
  return data_parallel(module.parameters(), mesh, options.row_sparse_parameters(row_sparse));
}

}  // namespace hyper_parallel::data_parallel
