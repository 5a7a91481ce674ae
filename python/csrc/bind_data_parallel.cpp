// data_parallel: the gradient reducer over a mesh dimension, for torch.nn modules' parameters.
// Its hooks and its final callback are C++; a Python backward() runs them without the GIL.
#include "bindings.h"

namespace hp_python {

namespace dp = hyper_parallel::data_parallel;

void bind_data_parallel(py::module& m) {
  py::class_<dp::GradientReducer, std::shared_ptr<dp::GradientReducer>>(m, "GradientReducer")
      .def_property("sync", &dp::GradientReducer::sync, &dp::GradientReducer::set_sync)
      .def("bucket_parameters", &dp::GradientReducer::bucket_parameters)
      .def("parameters", &dp::GradientReducer::parameters);
  py::class_<dp::ReplicaSync>(m, "ReplicaSync")
      .def(py::init<std::vector<at::Tensor>, const dtensor::DeviceMesh&, std::vector<std::string>, int64_t>(),
           py::arg("states"), py::arg("mesh"), py::arg("names"),
           py::arg("bucket_cap_bytes") = int64_t{256} << 20, py::call_guard<py::gil_scoped_release>())
      .def("__call__", &dp::ReplicaSync::operator(), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("bucket_count", &dp::ReplicaSync::bucket_count);
  m.def(
      "data_parallel",
      [](const std::vector<at::Tensor>& params, const dtensor::DeviceMesh& mesh, int64_t bucket_cap_bytes,
         bool overlap, bool gradient_as_bucket_view, const std::vector<at::Tensor>& row_sparse,
         const std::vector<std::string>& names) {
        return dp::data_parallel(params, mesh,
                                 dp::GradientReducerOptions()
                                     .bucket_cap_bytes(bucket_cap_bytes)
                                     .overlap(overlap)
                                     .gradient_as_bucket_view(gradient_as_bucket_view)
                                     .row_sparse_parameters(row_sparse),
                                 names);
      },
      py::arg("params"), py::arg("mesh"), py::arg("bucket_cap_bytes"), py::arg("overlap"),
      py::arg("gradient_as_bucket_view"), py::arg("row_sparse_parameters"),
      py::arg("names") = std::vector<std::string>{});
}

}  // namespace hp_python
