// core/comm: groups, collectives, counters.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>
#include <optional>

#include "bindings.h"

namespace hp_python {
namespace {

// comm's kinds and those of the layers above (MC2's fused ops).
comm::CollectiveKind kind_from_string(const std::string& name) {
  for (const auto kind : comm::kCommCollectiveKinds) {
    if (name == kind.name()) return kind;
  }
  for (const auto kind : {tp::kAllGatherMatmulKind, tp::kMatmulReduceScatterKind}) {
    if (name == kind.name()) return kind;
  }
  TORCH_CHECK_VALUE(false,
                    "collective_count: expected a collective kind such as 'all_gather' or "
                    "'matmul_reduce_scatter', got '",
                    name, "'");
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

void bind_groups(py::module& m) {
  py::class_<comm::Group>(m, "Group")
      .def_property_readonly("rank", &comm::Group::rank)
      .def("size", &comm::Group::size)
      .def_property_readonly("global_ranks", &comm::Group::global_ranks)
      .def_property_readonly("name", &comm::Group::name)
      .def_property_readonly("timeout_s", [](const comm::Group& g) { return g.timeout().count() / 1000.0; })
      .def("is_member", &comm::Group::is_member)
      .def("__repr__", [](const comm::Group& g) {
        return g.is_member() ? "Group(" + g.name() + ")" : std::string("Group(non-member)");
      });
  m.def(
      "init_process_group_from",
      [](c10::intrusive_ptr<c10d::ProcessGroup> world, c10::intrusive_ptr<c10d::Store> store,
         std::optional<double> timeout_s) {
        comm::InitOptions options;
        if (timeout_s) options.timeout(std::chrono::milliseconds(static_cast<int64_t>(*timeout_s * 1000)));
        comm::init_process_group_from(std::move(world), std::move(store), options);
      },
      py::arg("process_group"), py::arg("store"), py::arg("timeout_s") = py::none());
  m.def("is_initialized", &comm::is_initialized);
  m.def("destroy_process_group", &comm::destroy_process_group, py::call_guard<py::gil_scoped_release>());
  m.def("world", &comm::world);
  m.def("global_rank", &comm::global_rank);
  m.def("world_size", &comm::world_size);
  m.def("new_group", &comm::new_group, py::arg("ranks"));
  m.def(
      "as_group", [](py::handle g) { return group_arg(g); }, py::arg("group"),
      "The core's Group for a torch.distributed ProcessGroup (adopted) or a Group.");
  m.def(
      "get_hcomm_info", [](py::handle g) { return group_arg(g).name(); }, py::arg("group"),
      "The name of the communicator the core uses for `group`, equal on every rank of it.");
}

void bind_collectives(py::module& m) {
  py::enum_<comm::ReduceOp>(m, "ReduceOp")
      .value("SUM", comm::ReduceOp::kSum)
      .value("AVG", comm::ReduceOp::kAvg);
  m.def(
      "all_gather",
      [](const at::Tensor& t, int64_t dim, py::handle g, std::vector<int64_t> sizes) {
        return comm::all_gather(t, dim, group_arg(g), sizes);
      },
      py::arg("tensor"), py::arg("dim"), py::arg("group"), py::arg("sizes") = std::vector<int64_t>{});
  m.def(
      "reduce_scatter",
      [](const at::Tensor& t, int64_t dim, comm::ReduceOp op, py::handle g, std::vector<int64_t> sizes) {
        return comm::reduce_scatter(t, dim, op, group_arg(g), sizes);
      },
      py::arg("tensor"), py::arg("dim"), py::arg("op"), py::arg("group"),
      py::arg("sizes") = std::vector<int64_t>{});
  m.def(
      "all_reduce",
      [](const at::Tensor& t, comm::ReduceOp op, py::handle g) {
        return comm::all_reduce(t, op, group_arg(g));
      },
      py::arg("tensor"), py::arg("op"), py::arg("group"));
  m.def(
      "all_to_all",
      [](const at::Tensor& t, int64_t split_dim, int64_t concat_dim, py::handle g) {
        return comm::all_to_all(t, split_dim, concat_dim, group_arg(g));
      },
      py::arg("tensor"), py::arg("split_dim"), py::arg("concat_dim"), py::arg("group"));
  m.def(
      "broadcast",
      [](const at::Tensor& t, int64_t src, py::handle g) { return comm::broadcast(t, src, group_arg(g)); },
      py::arg("tensor"), py::arg("src"), py::arg("group"));
  m.def(
      "barrier", [](py::handle g) { comm::barrier(group_arg(g)); }, py::arg("group"));
}

void bind_lifecycle(py::module& m) {
  m.def("restart_count", &comm::restart_count);
  m.def("preemption_requested", &comm::preemption_requested);
  m.def(
      "agree_on_preemption", [](py::handle g) { return comm::agree_on_preemption(group_arg(g)); },
      py::arg("group"));
  m.def("maybe_kill_at_step", &comm::maybe_kill_at_step, py::arg("step"));
}

void bind_counters(py::module& m) {
  m.def(
      "collective_count",
      [](const std::string& kind, const std::string& region) {
        return comm::collective_count(kind_from_string(kind), region);
      },
      py::arg("kind"), py::arg("region") = "");
  m.def(
      "total_collective_count",
      [](const std::string& region) { return comm::total_collective_count(region); }, py::arg("region") = "");
  m.def("reset_collective_counts", &comm::reset_collective_counts);
  m.def("collective_counts_summary", &comm::collective_counts_summary);
  m.def(
      "payload_bytes_sent", [](const std::string& region) { return comm::payload_bytes_sent(region); },
      py::arg("region") = "");
  py::class_<PyCommRegion>(m, "CommRegion")
      .def(py::init<std::string>(), py::arg("name"))
      .def(
          "__enter__",
          [](PyCommRegion& r) {
            r.enter();
            return &r;
          },
          py::return_value_policy::reference)
      .def("__exit__", [](PyCommRegion& r, py::args) { r.exit(); });
}

}  // namespace

void bind_comm(py::module& m) {
  bind_groups(m);
  bind_collectives(m);
  bind_lifecycle(m);
  bind_counters(m);
}

}  // namespace hp_python
