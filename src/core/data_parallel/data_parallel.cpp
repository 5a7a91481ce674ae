#include <hyper_parallel/core/data_parallel/data_parallel.h>

#include <c10/util/Exception.h>

namespace hyper_parallel::data_parallel {

std::shared_ptr<GradientReducer> data_parallel(const std::vector<at::Tensor>& params,
                                               const dtensor::DeviceMesh& mesh,
                                               GradientReducerOptions options) {
  TORCH_CHECK_VALUE(mesh.ndim() == 1,
                    "data_parallel: expected a 1-D mesh (the data-parallel dimension, e.g. ",
                    "mesh[\"dp\"]), got a ", mesh.ndim(), "-D mesh");
  return std::make_shared<GradientReducer>(params, mesh.get_group(0), options);
}

std::shared_ptr<GradientReducer> data_parallel(torch::nn::Module& module, const dtensor::DeviceMesh& mesh,
                                               GradientReducerOptions options) {
  return data_parallel(module.parameters(), mesh, options);
}

}  // namespace hyper_parallel::data_parallel
