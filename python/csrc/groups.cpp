// Groups across the boundary: torch.distributed ProcessGroups adopted by the core, and handed
// back as the very objects torch made.
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "bindings.h"

namespace hp_python {

comm::Group group_arg(const py::handle& group) {
  if (py::isinstance<comm::Group>(group)) return group.cast<comm::Group>();
  c10::intrusive_ptr<c10d::ProcessGroup> backend;
  try {
    backend = group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  } catch (const py::cast_error&) {
    TORCH_CHECK_TYPE(false, "hyper_parallel: expected a torch.distributed ProcessGroup (or a hyper_parallel ",
                     "Group), got ", py::str(py::type::of(group).attr("__name__")).cast<std::string>());
  }
  if (!comm::is_initialized()) py::module::import("hyper_parallel.core.comm").attr("ensure_initialized")();
  const auto dist = py::module::import("torch.distributed");
  const auto ranks = dist.attr("get_process_group_ranks")(group).cast<std::vector<int64_t>>();
  const auto names = dist.attr("distributed_c10d").attr("_pg_names");
  const std::string name = names.contains(group) ? "torch:" + names[group].cast<std::string>() : "torch";
  return comm::adopt_group(std::move(backend), ranks, name);
}

py::object group_object(const comm::Group& group) { return py::cast(comm::backend_of(group)); }

at::ScalarType dtype_arg(const py::handle& dtype) {
  return torch::python::detail::py_object_to_dtype(py::reinterpret_borrow<py::object>(dtype));
}

py::object dtype_object(at::ScalarType dtype) {
  return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype)));
}

hpnn::ModuleKind module_kind_arg(const std::string& kind) {
  if (kind == "linear") return hpnn::ModuleKind::kLinear;
  if (kind == "embedding") return hpnn::ModuleKind::kEmbedding;
  return hpnn::ModuleKind::kOther;
}

}  // namespace hp_python
