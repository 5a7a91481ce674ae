// hyper_parallel._C: the C++ core, bound for Python. Nothing here computes: every function
// forwards to the library, so each message and each rule exists once, in C++. User errors keep
// their Python type (c10::ValueError -> ValueError, c10::TypeError -> TypeError,
// c10::NotImplementedError -> NotImplementedError). The one c10d type named here,
// ProcessGroup (with its Store), is only passed through to comm::init_process_group_from.
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/extension.h>
#include <torch/python.h>

#include <memory>
#include <optional>
#include <sstream>

#include <hyper_parallel/hyper_parallel.h>

#include "core/tensor_parallel/style_common.h"

namespace py = pybind11;
namespace comm = hyper_parallel::comm;
namespace dtensor = hyper_parallel::dtensor;
namespace tp = hyper_parallel::tensor_parallel;
namespace hpnn = hyper_parallel::nn;

namespace {

at::ScalarType to_dtype(const py::object& dtype) { return torch::python::detail::py_object_to_dtype(dtype); }

py::object from_dtype(at::ScalarType dtype) {
  return py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype)));
}

comm::CollectiveKind kind_from_string(const std::string& name) {
  for (int k = 0; k < comm::kNumCollectiveKinds; ++k) {
    const auto kind = static_cast<comm::CollectiveKind>(k);
    if (name == comm::to_string(kind)) return kind;
  }
  TORCH_CHECK_VALUE(false, "collective_count: expected a collective kind such as 'all_gather' or "
                    "'matmul_reduce_scatter', got '", name, "'");
}

hpnn::ModuleKind module_kind_from_string(const std::string& kind) {
  if (kind == "linear") return hpnn::ModuleKind::kLinear;
  if (kind == "embedding") return hpnn::ModuleKind::kEmbedding;
  return hpnn::ModuleKind::kOther;
}

// comm::CommRegion as a Python context manager.
class PyCommRegion {
 public:
  explicit PyCommRegion(std::string name) : name_(std::move(name)) {}
  void enter() { region_ = std::make_unique<comm::CommRegion>(name_); }
  void exit() { region_.reset(); }

 private:
  std::string name_;
  std::unique_ptr<comm::CommRegion> region_;
};

template <typename T>
std::string str_of(const T& value) {
  return value.str();
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hyper_parallel's C++ core (comm, dtensor, tensor_parallel, MC2)";

  // ---- core/comm --------------------------------------------------------------------------------
  py::class_<comm::Group>(m, "Group")
      .def_property_readonly("rank", &comm::Group::rank)
      .def("size", &comm::Group::size)
      .def_property_readonly("global_ranks", &comm::Group::global_ranks)
      .def_property_readonly("name", &comm::Group::name)
      .def("is_member", &comm::Group::is_member)
      .def("__repr__", [](const comm::Group& g) {
        return g.is_member() ? "Group(" + g.name() + ")" : std::string("Group(non-member)");
      });
  m.def(
      "init_process_group_from",
      [](c10::intrusive_ptr<c10d::ProcessGroup> world, c10::intrusive_ptr<c10d::Store> store,
         std::optional<double> timeout_s) {
        comm::InitOptions options;
        if (timeout_s) {
          options.timeout(std::chrono::milliseconds(static_cast<int64_t>(*timeout_s * 1000)));
        }
        comm::init_process_group_from(std::move(world), std::move(store), options);
      },
      py::arg("process_group"), py::arg("store"), py::arg("timeout_s") = py::none());
  m.def("is_initialized", &comm::is_initialized);
  m.def("destroy_process_group", &comm::destroy_process_group);
  m.def("world", &comm::world);
  m.def("global_rank", &comm::global_rank);
  m.def("world_size", &comm::world_size);
  m.def("new_group", &comm::new_group, py::arg("ranks"));

  py::enum_<comm::ReduceOp>(m, "ReduceOp").value("SUM", comm::ReduceOp::kSum).value("AVG", comm::ReduceOp::kAvg);
  m.def("all_gather", [](const at::Tensor& t, int64_t dim, const comm::Group& g, std::vector<int64_t> sizes) {
    return comm::all_gather(t, dim, g, sizes);
  }, py::arg("tensor"), py::arg("dim"), py::arg("group"), py::arg("sizes") = std::vector<int64_t>{});
  m.def("reduce_scatter", [](const at::Tensor& t, int64_t dim, comm::ReduceOp op, const comm::Group& g,
                             std::vector<int64_t> sizes) { return comm::reduce_scatter(t, dim, op, g, sizes); },
        py::arg("tensor"), py::arg("dim"), py::arg("op"), py::arg("group"), py::arg("sizes") = std::vector<int64_t>{});
  m.def("all_reduce", &comm::all_reduce, py::arg("tensor"), py::arg("op"), py::arg("group"));
  m.def("all_to_all", [](const at::Tensor& t, int64_t split_dim, int64_t concat_dim, const comm::Group& g) {
    return comm::all_to_all(t, split_dim, concat_dim, g);
  }, py::arg("tensor"), py::arg("split_dim"), py::arg("concat_dim"), py::arg("group"));
  m.def("broadcast", &comm::broadcast, py::arg("tensor"), py::arg("src"), py::arg("group"));
  m.def("barrier", &comm::barrier, py::arg("group"));

  m.def("collective_count", [](const std::string& kind, const std::string& region) {
    return comm::collective_count(kind_from_string(kind), region);
  }, py::arg("kind"), py::arg("region") = "");
  m.def("total_collective_count", [](const std::string& region) { return comm::total_collective_count(region); },
        py::arg("region") = "");
  m.def("reset_collective_counts", &comm::reset_collective_counts);
  m.def("collective_counts_summary", &comm::collective_counts_summary);
  m.def("payload_bytes_sent", [](const std::string& region) { return comm::payload_bytes_sent(region); },
        py::arg("region") = "");
  py::class_<PyCommRegion>(m, "CommRegion")
      .def(py::init<std::string>(), py::arg("name"))
      .def("__enter__", [](PyCommRegion& r) { r.enter(); return &r; }, py::return_value_policy::reference)
      .def("__exit__", [](PyCommRegion& r, py::args) { r.exit(); });

  // ---- core/dtensor -----------------------------------------------------------------------------
  py::class_<dtensor::Placement>(m, "Placement")
      .def(py::init([](const std::string& kind, int64_t dim, comm::ReduceOp op) {
             if (kind == "shard") return dtensor::Placement::shard(dim);
             if (kind == "replicate") return dtensor::Placement::replicate();
             TORCH_CHECK_VALUE(kind == "partial", "Placement: expected kind 'shard', 'replicate' or "
                               "'partial', got '", kind, "'");
             return dtensor::Placement::partial(op);
           }),
           py::arg("kind"), py::arg("dim") = 0, py::arg("reduce_op") = comm::ReduceOp::kSum)
      .def("is_shard", [](const dtensor::Placement& p, std::optional<int64_t> dim) {
        return dim ? p.is_shard(*dim) : p.is_shard();
      }, py::arg("dim") = py::none())
      .def("is_replicate", &dtensor::Placement::is_replicate)
      .def("is_partial", &dtensor::Placement::is_partial)
      .def_property_readonly("dim", &dtensor::Placement::dim)
      .def_property_readonly("reduce_op", &dtensor::Placement::reduce_op)
      .def("__eq__", [](const dtensor::Placement& a, const dtensor::Placement& b) { return a == b; })
      .def("__hash__", [](const dtensor::Placement& p) { return std::hash<std::string>()(p.str()); })
      .def("__repr__", &str_of<dtensor::Placement>);

  py::class_<dtensor::DeviceMesh>(m, "DeviceMesh")
      .def_property_readonly("device_type", &dtensor::DeviceMesh::device_type)
      .def_property_readonly("ndim", &dtensor::DeviceMesh::ndim)
      .def_property_readonly("shape", &dtensor::DeviceMesh::shape)
      .def_property_readonly("mesh_dim_names", &dtensor::DeviceMesh::dim_names)
      .def("size", [](const dtensor::DeviceMesh& mesh, std::optional<int64_t> dim) {
        return dim ? mesh.size(*dim) : mesh.size();
      }, py::arg("mesh_dim") = py::none())
      .def("get_group", [](const dtensor::DeviceMesh& mesh, py::object dim) {
        if (py::isinstance<py::str>(dim)) return mesh.get_group(dim.cast<std::string>());
        return mesh.get_group(dim.is_none() ? 0 : dim.cast<int64_t>());
      }, py::arg("mesh_dim") = py::none())
      .def("get_local_rank", [](const dtensor::DeviceMesh& mesh, py::object dim) {
        return mesh.get_local_rank(py::isinstance<py::str>(dim) ? mesh.dim_index(dim.cast<std::string>())
                                                                : (dim.is_none() ? 0 : dim.cast<int64_t>()));
      }, py::arg("mesh_dim") = py::none())
      .def("get_coordinate", &dtensor::DeviceMesh::coordinate)
      .def_property_readonly("ranks", &dtensor::DeviceMesh::ranks)
      .def("__getitem__", &dtensor::DeviceMesh::operator[])
      .def("__eq__", [](const dtensor::DeviceMesh& a, const dtensor::DeviceMesh& b) { return a == b; })
      .def("__repr__", &str_of<dtensor::DeviceMesh>);
  m.def("init_device_mesh", &dtensor::init_device_mesh, py::arg("device_type"), py::arg("mesh_shape"),
        py::arg("mesh_dim_names") = std::vector<std::string>{});

  py::class_<dtensor::DTensor>(m, "DTensor")
      .def_static("from_local", [](const at::Tensor& local, const dtensor::DeviceMesh& mesh,
                                   const dtensor::Placements& placements, bool run_check,
                                   std::optional<std::vector<int64_t>> shape) {
        return dtensor::DTensor::from_local(local, mesh, placements,
                                            dtensor::FromLocalOptions().run_check(run_check).shape(shape));
      }, py::arg("local"), py::arg("device_mesh"), py::arg("placements"), py::arg("run_check") = false,
         py::arg("shape") = py::none())
      .def_static("from_tagged", &dtensor::DTensor::from_tagged, py::arg("local"))
      .def("to_local", [](const dtensor::DTensor& d, std::optional<dtensor::Placements> grad_placements) {
        return grad_placements ? d.to_local(*grad_placements) : d.to_local();
      }, py::arg("grad_placements") = py::none())
      .def("to_local_tagged", &dtensor::DTensor::to_local_tagged)
      .def("redistribute", &dtensor::DTensor::redistribute, py::arg("placements"))
      .def("full_tensor", &dtensor::DTensor::full_tensor)
      .def_property_readonly("placements", &dtensor::DTensor::placements)
      .def_property_readonly("shape", &dtensor::DTensor::shape)
      .def_property_readonly("device_mesh", &dtensor::DTensor::device_mesh)
      .def("__repr__", &str_of<dtensor::DTensor>);
  m.def("distribute_tensor", &dtensor::distribute_tensor, py::arg("tensor"), py::arg("device_mesh"),
        py::arg("placements"), py::arg("src_data_rank") = 0);

  // ---- core/tensor_parallel: what the Python styles do, one call per tensor operation ----------
  m.def("check_tp_mesh", &tp::check_tp_mesh, py::arg("where"), py::arg("mesh"));
  m.def("shard_tensor_in_place", &tp::detail::shard_tensor_in_place, py::arg("param"), py::arg("mesh"),
        py::arg("placements"), py::arg("src_data_rank"));
  m.def("sum_gradient_over_mesh", &tp::detail::sum_gradient_over_mesh, py::arg("param"), py::arg("mesh"));
  m.def("prepare", &tp::detail::prepare, py::arg("local"), py::arg("mesh"), py::arg("from_placement"),
        py::arg("to_placement"), py::arg("use_local_output"));
  m.def("replicate_for_column", &tp::detail::replicate_for_column, py::arg("local"), py::arg("mesh"),
        py::arg("layout"));
  m.def("rowwise_linear", [](const at::Tensor& x, const at::Tensor& w, std::optional<at::Tensor> bias,
                             const dtensor::DeviceMesh& mesh, const dtensor::Placement& output, bool use_local) {
    return tp::detail::rowwise_linear(x, w, bias.value_or(at::Tensor()), mesh, output, use_local);
  });
  m.def("rowwise_embedding", &tp::detail::rowwise_embedding);
  m.def("sequence_sharded_input", [](const std::string& style, const at::Tensor& local,
                                     const dtensor::DeviceMesh& mesh, const dtensor::Placement& layout) {
    return tp::detail::sequence_sharded_input(style.c_str(), local, mesh, layout);
  });
  m.def("check_plan_agrees", &tp::check_plan_agrees, py::arg("lines"), py::arg("mesh"));

  // ---- MC2 ----------------------------------------------------------------------------------------
  py::class_<tp::MC2Options>(m, "MC2Options")
      .def(py::init([](int64_t chunks) { return tp::MC2Options().chunks_per_rank(chunks); }),
           py::arg("chunks_per_rank") = 2)
      .def_property_readonly("chunks_per_rank", [](const tp::MC2Options& o) { return o.chunks_per_rank(); });
  py::class_<tp::MC2Contract>(m, "MC2Contract")
      .def_static("strict", &tp::MC2Contract::strict)
      .def_static("relaxed", &tp::MC2Contract::relaxed)
      .def_property_readonly("min_k", [](const tp::MC2Contract& c) { return c.min_k(); })
      .def_property_readonly("max_k", [](const tp::MC2Contract& c) { return c.max_k(); })
      .def_property_readonly("world_sizes", [](const tp::MC2Contract& c) { return c.world_sizes(); })
      .def_property_readonly("dtypes", [](const tp::MC2Contract& c) {
        py::list out;
        for (auto d : c.dtypes()) out.append(from_dtype(d));
        return out;
      })
      .def("check_dtype", [](const tp::MC2Contract& c, const std::string& where, py::object dtype) {
        c.check_dtype(where.c_str(), to_dtype(dtype));
      })
      .def("check_k", [](const tp::MC2Contract& c, const std::string& where, const std::string& what, int64_t k) {
        c.check_k(where.c_str(), what.c_str(), k);
      })
      .def("check_world_size", [](const tp::MC2Contract& c, const std::string& where, int64_t ws) {
        c.check_world_size(where.c_str(), ws);
      });
  m.def("mc2_mode_from_string", [](const std::string& mode) { return tp::to_string(tp::mc2_mode_from_string(mode)); });
  m.def("all_gather_matmul", &tp::all_gather_matmul, py::arg("x"), py::arg("w"), py::arg("group"),
        py::arg("options") = tp::MC2Options());
  m.def("matmul_reduce_scatter", &tp::matmul_reduce_scatter, py::arg("x"), py::arg("w"), py::arg("group"),
        py::arg("options") = tp::MC2Options());
  m.def("sequence_rows", &tp::sequence_rows, py::arg("x"), py::arg("sequence_dim"));
  m.def("from_sequence_rows", &tp::from_sequence_rows, py::arg("rows"), py::arg("like"),
        py::arg("sequence_dim"), py::arg("seq_len"));

  // The state and forward of an MC2Linear (the Python MC2Linear, a torch.nn.Linear, holds one).
  py::class_<tp::MC2Linear>(m, "MC2LinearState")
      .def(py::init(&tp::MC2Linear::standalone))
      .def("configure_mc2", [](const tp::MC2Linear& l, const std::string& mode, const comm::Group& group,
                               int64_t sequence_dim, const tp::MC2Contract& contract, const tp::MC2Options& options) {
        l.configure_mc2(tp::mc2_mode_from_string(mode), group, sequence_dim, contract, options);
      }, py::arg("mode"), py::arg("group"), py::arg("sequence_dim"), py::arg("contract"), py::arg("options"))
      .def("forward", [](const tp::MC2Linear& l, const at::Tensor& x, const at::Tensor& w,
                         std::optional<at::Tensor> bias) { return l.forward(x, w, bias.value_or(at::Tensor())); })
      .def_property_readonly("is_configured", &tp::MC2Linear::is_configured)
      .def_property_readonly("mode", [](const tp::MC2Linear& l) {
        return l.is_configured() ? std::string(tp::to_string(l.mode())) : std::string();
      })
      .def_property_readonly("group", &tp::MC2Linear::group)
      .def_property_readonly("world_size", &tp::MC2Linear::world_size)
      .def_property_readonly("sequence_dim", &tp::MC2Linear::sequence_dim);

  // The MC2 styles' own checks (layouts at construction; kind and contract per module).
  py::class_<tp::MC2ColwiseParallel>(m, "MC2ColwiseParallelChecks")
      .def(py::init([](const dtensor::Placement& in, const dtensor::Placement& out, bool use_local,
                       const tp::MC2Contract& contract, const tp::MC2Options& options) {
        return tp::MC2ColwiseParallel(tp::MC2ColwiseParallelOptions()
                                          .input_layouts(in)
                                          .output_layouts(out)
                                          .use_local_output(use_local)
                                          .contract(contract)
                                          .mc2_options(options));
      }))
      .def("check_target", [](const tp::MC2ColwiseParallel& s, const std::string& kind, const std::string& name,
                              std::vector<int64_t> shape, py::object dtype, const dtensor::DeviceMesh& mesh) {
        s.check_target(module_kind_from_string(kind), name, "torch.nn.Linear", shape, to_dtype(dtype), mesh);
      });
  py::class_<tp::MC2RowwiseParallel>(m, "MC2RowwiseParallelChecks")
      .def(py::init([](const dtensor::Placement& in, const dtensor::Placement& out, bool use_local,
                       const tp::MC2Contract& contract, const tp::MC2Options& options) {
        return tp::MC2RowwiseParallel(tp::MC2RowwiseParallelOptions()
                                          .input_layouts(in)
                                          .output_layouts(out)
                                          .use_local_output(use_local)
                                          .contract(contract)
                                          .mc2_options(options));
      }))
      .def("check_target", [](const tp::MC2RowwiseParallel& s, const std::string& kind, const std::string& name,
                              std::vector<int64_t> shape, py::object dtype, const dtensor::DeviceMesh& mesh) {
        s.check_target(module_kind_from_string(kind), name, "torch.nn.Linear", shape, to_dtype(dtype), mesh);
      });
}
