// core/dtensor: placements, DeviceMesh, DTensor.
#include <optional>

#include "bindings.h"

namespace hp_python {
namespace {

template <typename T>
std::string str_of(const T& value) {
  return value.str();
}

void bind_placement(py::module& m) {
  py::class_<dtensor::Placement>(m, "Placement")
      .def(py::init([](const std::string& kind, int64_t dim, comm::ReduceOp op) {
             if (kind == "shard") return dtensor::Placement::shard(dim);
             if (kind == "replicate") return dtensor::Placement::replicate();
             TORCH_CHECK_VALUE(kind == "partial",
                               "Placement: expected kind 'shard', 'replicate' or "
                               "'partial', got '",
                               kind, "'");
             return dtensor::Placement::partial(op);
           }),
           py::arg("kind"), py::arg("dim") = 0, py::arg("reduce_op") = comm::ReduceOp::kSum)
      .def(
          "is_shard",
          [](const dtensor::Placement& p, std::optional<int64_t> dim) {
            return dim ? p.is_shard(*dim) : p.is_shard();
          },
          py::arg("dim") = py::none())
      .def("is_replicate", &dtensor::Placement::is_replicate)
      .def("is_partial", &dtensor::Placement::is_partial)
      .def_property_readonly("dim", &dtensor::Placement::dim)
      .def_property_readonly("reduce_op", &dtensor::Placement::reduce_op)
      // Anything that is not a Placement is simply not equal (x in [None, Shard(1)] works).
      .def("__eq__",
           [](const dtensor::Placement& a, const py::object& b) -> py::object {
             if (!py::isinstance<dtensor::Placement>(b))
               return py::reinterpret_borrow<py::object>(Py_NotImplemented);
             return py::bool_(a == b.cast<dtensor::Placement>());
           })
      .def("__hash__", [](const dtensor::Placement& p) { return std::hash<std::string>()(p.str()); })
      .def("__repr__", &str_of<dtensor::Placement>);
}

int64_t mesh_dim_arg(const dtensor::DeviceMesh& mesh, const py::object& dim) {
  if (py::isinstance<py::str>(dim)) return mesh.dim_index(dim.cast<std::string>());
  return dim.is_none() ? 0 : dim.cast<int64_t>();
}

void bind_device_mesh(py::module& m) {
  py::class_<dtensor::DeviceMesh>(m, "DeviceMesh")
      .def_property_readonly("device_type", &dtensor::DeviceMesh::device_type)
      .def_property_readonly("ndim", &dtensor::DeviceMesh::ndim)
      .def_property_readonly("shape", &dtensor::DeviceMesh::shape)
      .def_property_readonly("mesh_dim_names", &dtensor::DeviceMesh::dim_names)
      .def(
          "size",
          [](const dtensor::DeviceMesh& mesh, std::optional<int64_t> dim) {
            return dim ? mesh.size(*dim) : mesh.size();
          },
          py::arg("mesh_dim") = py::none())
      .def(
          "get_group",
          [](const dtensor::DeviceMesh& mesh, const py::object& dim) {
            if (dim.is_none()) return group_object(mesh.get_group());
            return group_object(mesh.get_group(mesh_dim_arg(mesh, dim)));
          },
          py::arg("mesh_dim") = py::none(), "The torch.distributed ProcessGroup of a mesh dim.")
      .def(
          "get_local_rank",
          [](const dtensor::DeviceMesh& mesh, const py::object& dim) {
            return mesh.get_local_rank(mesh_dim_arg(mesh, dim));
          },
          py::arg("mesh_dim") = py::none())
      .def("get_coordinate", &dtensor::DeviceMesh::coordinate)
      .def_property_readonly("ranks", &dtensor::DeviceMesh::ranks)
      .def(
          "__getitem__",
          [](const dtensor::DeviceMesh& mesh, const py::object& names) {
            // mesh["tp"], or mesh["replicate", "shard"] for the mesh along several dims
            if (py::isinstance<py::str>(names)) return mesh[names.cast<std::string>()];
            return mesh[names.cast<std::vector<std::string>>()];
          },
          py::arg("names"))
      .def("__eq__",
           [](const dtensor::DeviceMesh& a, const py::object& b) {
             return py::isinstance<dtensor::DeviceMesh>(b) && a == b.cast<dtensor::DeviceMesh>();
           })
      .def("__hash__", [](const dtensor::DeviceMesh& mesh) { return std::hash<std::string>()(mesh.str()); })
      .def("__repr__", &str_of<dtensor::DeviceMesh>);
  // A mesh of another library (torch's, the original's) that offers get_group() and size(): the
  // 1-d mesh over its group.
  m.def(
      "mesh_of_group",
      [](const py::handle& group, int64_t size) {
        const auto g = group_arg(group);
        TORCH_CHECK_VALUE(g.is_member() && g.size() == size, "DeviceMesh: expected a mesh whose size() (",
                          size, ") equals its get_group()'s size, got a group of ",
                          g.is_member() ? g.size() : 0, " ranks");
        return dtensor::DeviceMesh::from_group(g);
      },
      py::arg("group"), py::arg("size"));
  // make_group(ranks) makes one line's group (a torch.distributed ProcessGroup, or None for a
  // line this rank is not in); every rank calls it for every line, in the same order.
  m.def(
      "init_device_mesh",
      [](const std::string& device_type, const std::vector<int64_t>& shape,
         const std::vector<std::string>& names, const py::object& make_group) {
        dtensor::DeviceMesh::GroupFactory factory;
        if (!make_group.is_none()) {
          factory = [make_group](const std::vector<int64_t>& ranks) {
            py::object g = make_group(ranks);
            return g.is_none() ? comm::Group() : group_arg(g);
          };
        }
        return dtensor::init_device_mesh(device_type, shape, names, factory);
      },
      py::arg("device_type"), py::arg("mesh_shape"), py::arg("mesh_dim_names") = std::vector<std::string>{},
      py::arg("make_group") = py::none());
}

void bind_dtensor_class(py::module& m) {
  py::class_<dtensor::DTensor>(m, "DTensor")
      .def_static(
          "from_local",
          [](const at::Tensor& local, const dtensor::DeviceMesh& mesh, const dtensor::Placements& placements,
             bool run_check, std::optional<std::vector<int64_t>> shape) {
            return dtensor::DTensor::from_local(
                local, mesh, placements, dtensor::FromLocalOptions().run_check(run_check).shape(shape));
          },
          py::arg("local"), py::arg("device_mesh"), py::arg("placements"), py::arg("run_check") = false,
          py::arg("shape") = py::none())
      .def_static("from_tagged", &dtensor::DTensor::from_tagged, py::arg("local"))
      .def_static("carry_tag", &dtensor::DTensor::carry_tag, py::arg("from"), py::arg("to"))
      .def_static(
          "trace_back",
          [](const at::Tensor& t, int64_t max_nodes) {
            auto trace = dtensor::DTensor::trace_back(t, max_nodes);
            return std::make_tuple(trace.tagged, trace.mixed_by, trace.other_gradient,
                                   trace.from_leaves_only);
          },
          py::arg("t"), py::arg("max_nodes") = 64)
      .def(
          "to_local",
          [](const dtensor::DTensor& d, std::optional<dtensor::Placements> grad_placements) {
            return grad_placements ? d.to_local(*grad_placements) : d.to_local();
          },
          py::arg("grad_placements") = py::none())
      .def("to_local_tagged", &dtensor::DTensor::to_local_tagged)
      .def("redistribute", &dtensor::DTensor::redistribute, py::arg("placements"))
      .def("full_tensor", &dtensor::DTensor::full_tensor)
      .def_property_readonly("placements", &dtensor::DTensor::placements)
      .def_property_readonly("shape", &dtensor::DTensor::shape)
      .def_property_readonly("device_mesh", &dtensor::DTensor::device_mesh)
      .def("__repr__", &str_of<dtensor::DTensor>);
  m.def("distribute_tensor", &dtensor::distribute_tensor, py::arg("tensor"), py::arg("device_mesh"),
        py::arg("placements"), py::arg("src_data_rank") = 0);
}

}  // namespace

void bind_dtensor(py::module& m) {
  bind_placement(m);
  bind_device_mesh(m);
  bind_dtensor_class(m);
}

}  // namespace hp_python
