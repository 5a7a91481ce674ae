// core/dtensor: placements, DeviceMesh, DTensor.
#include <algorithm>
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

// A mesh argument that may be None: the mesh entered last on this thread (`with mesh:`).
dtensor::DeviceMesh mesh_or_current(const py::object& mesh) {
  return mesh.is_none() ? dtensor::DeviceMesh::current() : mesh.cast<dtensor::DeviceMesh>();
}

bool is_name_or_names(const py::handle& entry) {
  if (py::isinstance<py::str>(entry)) return true;
  if (!py::isinstance<py::tuple>(entry) && !py::isinstance<py::list>(entry)) return false;
  const auto names = py::reinterpret_borrow<py::sequence>(entry);
  if (names.size() == 0) return false;
  for (const auto& name : names) {
    if (!py::isinstance<py::str>(name)) return false;
  }
  return true;
}

// Placements as Placement objects, or as the original's layout names (one entry per tensor dim:
// a mesh dim's name, "None", or a tuple of names), read by dtensor::placements_from_names; None
// replicates over every mesh dim.
dtensor::Placements placements_arg(const py::handle& placements, const dtensor::DeviceMesh& mesh,
                                   int64_t ndim) {
  if (placements.is_none()) return dtensor::Placements(mesh.ndim(), dtensor::Replicate());  // torch's default
  const bool sequence = py::isinstance<py::tuple>(placements) || py::isinstance<py::list>(placements);
  TORCH_CHECK_TYPE(sequence, "DTensor: expected placements as a list or tuple, got ",
                   py::str(py::type::handle_of(placements)).cast<std::string>());
  const auto entries = py::reinterpret_borrow<py::sequence>(placements);
  bool names = entries.size() > 0;
  for (const auto& entry : entries) names = names && is_name_or_names(entry);
  if (!names) {
    for (const auto& entry : entries) {
      TORCH_CHECK_TYPE(py::isinstance<dtensor::Placement>(entry),
                       "DTensor: expected placements (Shard, Replicate, Partial) or layout names, got ",
                       py::repr(placements).cast<std::string>());
    }
    return placements.cast<dtensor::Placements>();
  }
  std::vector<std::vector<std::string>> tensor_dims;
  for (const auto& entry : entries) {
    if (py::isinstance<py::str>(entry)) {
      tensor_dims.push_back({entry.cast<std::string>()});
    } else {
      tensor_dims.push_back(entry.cast<std::vector<std::string>>());
    }
  }
  return dtensor::placements_from_names(tensor_dims, mesh.dim_names(), ndim);
}

py::object torch_size(const std::vector<int64_t>& shape) {
  return py::module::import("torch").attr("Size")(py::tuple(py::cast(shape)));
}

// DeviceMesh(...), `with mesh:` and the attributes torch's and the original's meshes offer.
// DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp")) is collective: every rank
// passes the same arguments (the package reads `mesh`).
void bind_device_mesh_spelled_as_torch(py::class_<dtensor::DeviceMesh>& cls) {
  cls.def(py::init([](const std::string& device_type, const py::object& mesh, const py::object& names) {
            const auto args =
                py::module::import("hyper_parallel.core.dtensor.device_mesh").attr("_mesh_arguments")(mesh);
            const auto make_group = args[py::int_(2)];
            return dtensor::DeviceMesh(
                device_type, args[py::int_(0)].cast<std::vector<int64_t>>(),
                args[py::int_(1)].cast<std::vector<int64_t>>(),
                names.is_none() ? std::vector<std::string>{} : names.cast<std::vector<std::string>>(),
                [make_group](const std::vector<int64_t>& ranks) {
                  py::object g = make_group(ranks);
                  return g.is_none() ? comm::Group() : group_arg(g);
                });
          }),
          py::arg("device_type"), py::arg("mesh") = py::none(), py::kw_only(),
          py::arg("mesh_dim_names") = py::none())
      .def("__enter__",
           [](const dtensor::DeviceMesh& mesh) {
             mesh.enter();
             return mesh;
           })
      .def("__exit__",
           [](const dtensor::DeviceMesh& mesh, const py::args&) {
             mesh.exit();
             return false;
           })
      .def_static("get_current_mesh", &dtensor::DeviceMesh::current)
      .def_property_readonly(
          "mesh_shape", [](const dtensor::DeviceMesh& mesh) { return py::tuple(py::cast(mesh.shape())); })
      .def_property_readonly(
          "rank_list", [](const dtensor::DeviceMesh& mesh) { return py::tuple(py::cast(mesh.ranks())); })
      .def_property_readonly("mesh",
                             [](const dtensor::DeviceMesh& mesh) {
                               return py::module::import("torch")
                                   .attr("tensor")(mesh.ranks())
                                   .attr("view")(py::tuple(py::cast(mesh.shape())));
                             })
      .def("get_rank", [](const dtensor::DeviceMesh&) { return comm::global_rank(); });
}

// mesh["tp"], or mesh["replicate", "shard"] for the mesh along several dims.
dtensor::DeviceMesh mesh_slice(const dtensor::DeviceMesh& mesh, const py::object& names) {
  if (py::isinstance<py::str>(names)) return mesh[names.cast<std::string>()];
  const bool all_names =
      (py::isinstance<py::tuple>(names) || py::isinstance<py::list>(names)) &&
      std::all_of(names.begin(), names.end(), [](const py::handle& n) { return py::isinstance<py::str>(n); });
  TORCH_CHECK_TYPE(all_names, "DeviceMesh.__getitem__: expected a mesh dim name or a tuple of them, got ",
                   py::repr(names).cast<std::string>(), " (a mesh is sliced by its mesh_dim_names)");
  return mesh[names.cast<std::vector<std::string>>()];
}

void bind_device_mesh(py::module& m) {
  py::class_<dtensor::DeviceMesh> cls(m, "DeviceMesh");
  bind_device_mesh_spelled_as_torch(cls);
  cls.def_property_readonly("device_type", &dtensor::DeviceMesh::device_type)
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
            return dim.is_none() ? mesh.get_local_rank() : mesh.get_local_rank(mesh_dim_arg(mesh, dim));
          },
          py::arg("mesh_dim") = py::none())
      .def("get_coordinate",
           [](const dtensor::DeviceMesh& mesh) -> std::optional<std::vector<int64_t>> {
             const auto& ranks = mesh.ranks();
             if (std::find(ranks.begin(), ranks.end(), comm::global_rank()) == ranks.end())
               return std::nullopt;
             return mesh.coordinate();  // None on a rank outside the mesh, as torch's
           })
      .def_property_readonly("ranks", &dtensor::DeviceMesh::ranks)
      .def("__getitem__", &mesh_slice, py::arg("names"))
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

// DTensor.from_local's and DTensor(...)'s arguments: the mesh may be None (the current one) and
// the placements Placement objects or layout names.
dtensor::DTensor from_local_arg(const at::Tensor& local, const py::object& mesh_arg,
                                const py::object& placements, bool run_check,
                                std::optional<std::vector<int64_t>> shape) {
  const auto mesh = mesh_or_current(mesh_arg);
  return dtensor::DTensor::from_local(local, mesh, placements_arg(placements, mesh, local.dim()),
                                      dtensor::FromLocalOptions().run_check(run_check).shape(shape));
}

// redistribute(placements), as before, or torch's and the original's (device_mesh, placements).
dtensor::DTensor redistribute_arg(const dtensor::DTensor& d, const py::object& first,
                                  const py::object& second) {
  const bool mesh_first = first.is_none() || py::isinstance<dtensor::DeviceMesh>(first);
  TORCH_CHECK_TYPE(mesh_first || second.is_none(),
                   "DTensor.redistribute: expected (device_mesh, placements), "
                   "got ",
                   py::repr(first).cast<std::string>(), " as the device_mesh");
  const py::object placements = mesh_first ? second : first;
  TORCH_CHECK_VALUE(!placements.is_none(), "DTensor.redistribute: expected placements, got None");
  const auto mesh = mesh_first && !first.is_none() ? first.cast<dtensor::DeviceMesh>() : d.device_mesh();
  return d.redistribute(mesh, placements_arg(placements, mesh, d.dim()));
}

py::class_<dtensor::DTensor> bind_dtensor_class(py::module& m) {
  py::class_<dtensor::DTensor> cls(m, "DTensor");
  cls.def(py::init([](const at::Tensor& local, const py::object& mesh, const py::object& placements,
                      bool run_check, std::optional<std::vector<int64_t>> shape) {
            return from_local_arg(local, mesh, placements, run_check, std::move(shape));
          }),
          py::arg("local_tensor"), py::arg("device_mesh"), py::arg("placements"), py::kw_only(),
          py::arg("run_check") = false, py::arg("shape") = py::none())
      .def_static("from_local", &from_local_arg, py::arg("local_tensor"), py::arg("device_mesh") = py::none(),
                  py::arg("placements") = py::none(), py::arg("run_check") = false,
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
          [](const dtensor::DTensor& d, const py::object& grad_placements) {
            if (grad_placements.is_none()) return d.to_local();
            return d.to_local(placements_arg(grad_placements, d.device_mesh(), d.dim()));
          },
          py::arg("grad_placements") = py::none())
      .def("to_local_tagged", &dtensor::DTensor::to_local_tagged)
      .def(
          "redistribute",
          [](const dtensor::DTensor& d, const py::object& first, const py::object& second,
             bool /*async_op*/) {
            // torch's async_op=True defers the wait to the first use; here the result is ready.
            return redistribute_arg(d, first, second);
          },
          py::arg("device_mesh") = py::none(), py::arg("placements") = py::none(), py::kw_only(),
          py::arg("async_op") = false)
      .def("reduce_partial", &dtensor::DTensor::reduce_partial)
      .def(
          "full_tensor",
          [](const dtensor::DTensor& d, const py::object& grad_placements) {
            if (grad_placements.is_none()) return d.full_tensor();
            // torch's meaning: replicated, then to_local with the gradient's placements.
            const dtensor::Placements replicated(static_cast<size_t>(d.device_mesh().ndim()),
                                                 dtensor::Replicate());
            return d.redistribute(d.device_mesh(), replicated)
                .to_local(placements_arg(grad_placements, d.device_mesh(), d.dim()));
          },
          py::kw_only(), py::arg("grad_placements") = py::none())
      .def_property_readonly(
          "placements",
          [](const dtensor::DTensor& d) {
            // Shard / Replicate / Partial, as isinstance checks expect
            const auto as_python =
                py::module::import("hyper_parallel.core.dtensor.placement_types").attr("as_python");
            py::list out;
            for (const auto& p : d.placements()) out.append(as_python(p));
            return py::tuple(out);
          })
      .def_property_readonly("device_mesh", &dtensor::DTensor::device_mesh)
      .def("__repr__", &str_of<dtensor::DTensor>);
  return cls;
}

// What code written for torch's DTensor and the original's reads of a tensor: the global shape
// and the local tensor's dtype and device; conversions keep the layout.
void bind_dtensor_tensor_methods(py::module& m, py::class_<dtensor::DTensor>& cls) {
  cls.def_property_readonly("shape", [](const dtensor::DTensor& d) { return torch_size(d.shape()); })
      .def(
          "size",
          [](const dtensor::DTensor& d, const py::object& dim) -> py::object {
            if (dim.is_none()) return torch_size(d.shape());
            return torch_size(d.shape())[dim];
          },
          py::arg("dim") = py::none())
      .def("numel", &dtensor::DTensor::numel)
      .def("dim", &dtensor::DTensor::dim)
      .def_property_readonly("ndim", &dtensor::DTensor::dim)
      .def_property_readonly("local_shape",
                             [](const dtensor::DTensor& d) { return torch_size(d.to_local().sizes().vec()); })
      .def_property_readonly("dtype", [](const dtensor::DTensor& d) { return dtype_object(d.scalar_type()); })
      .def_property_readonly("device",
                             [](const dtensor::DTensor& d) { return py::cast(d.to_local()).attr("device"); })
      .def_property_readonly("requires_grad", &dtensor::DTensor::requires_grad)
      .def("to",
           [](const dtensor::DTensor& d, const py::args& args, const py::kwargs& kwargs) {
             return d.with_local(py::cast(d.to_local()).attr("to")(*args, **kwargs).cast<at::Tensor>());
           })
      .def("float", [](const dtensor::DTensor& d) { return d.with_local(d.to_local().to(at::kFloat)); })
      .def("detach", [](const dtensor::DTensor& d) { return d.with_local(d.to_local().detach()); })
      .def("copy_", &dtensor::DTensor::copy_, py::arg("src"), py::return_value_policy::copy)
      .def("zero_",
           [](const dtensor::DTensor& d) {
             d.to_local().zero_();
             return d;
           })
      .def(
          "fill_",
          [](const dtensor::DTensor& d, const py::object& value) {
            py::cast(d.to_local()).attr("fill_")(value);
            return d;
          },
          py::arg("value"));
  m.def(
      "distribute_tensor",
      [](const at::Tensor& tensor, const py::object& mesh_arg, const py::object& placements,
         std::optional<int64_t> src_data_rank) {
        const auto mesh = mesh_or_current(mesh_arg);
        return dtensor::distribute_tensor(tensor, mesh, placements_arg(placements, mesh, tensor.dim()),
                                          src_data_rank);
      },
      py::arg("tensor"), py::arg("device_mesh") = py::none(), py::arg("placements") = py::none(),
      py::arg("src_data_rank") = 0);
  m.def(
      "local_shape",
      [](const std::vector<int64_t>& global_shape, const dtensor::DeviceMesh& mesh,
         const py::object& placements) {
        const auto pl = placements_arg(placements, mesh, static_cast<int64_t>(global_shape.size()));
        return dtensor::local_shape(global_shape, mesh.shape(), mesh.coordinate(), pl);
      },
      py::arg("global_shape"), py::arg("device_mesh"), py::arg("placements"));
}

}  // namespace

void bind_dtensor(py::module& m) {
  bind_placement(m);
  bind_device_mesh(m);
  auto cls = bind_dtensor_class(m);
  bind_dtensor_tensor_methods(m, cls);
}

}  // namespace hp_python
