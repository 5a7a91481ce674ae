// core/tensor_parallel/mc2: the contract, the fused ops, the fused Linear's passes (which the
// Python AllGatherMatmulFunction / MatmulReduceScatterFunction run), MC2Linear's state and the
// MC2 styles.
#include <optional>

#include "bindings.h"

namespace hp_python {
namespace {

at::Tensor or_undefined(const std::optional<at::Tensor>& t) { return t.value_or(at::Tensor()); }

py::tuple grads_tuple(const tp::MC2LinearGrads& g) {
  auto value = [](const at::Tensor& t) { return t.defined() ? py::cast(t) : py::none(); };
  return py::make_tuple(value(g.input), value(g.weight), value(g.bias));
}

// chunks_per_rank: a count >= 1, or "auto" (MC2Options::kAutoChunks).
int64_t chunks_from_python(const py::object& chunks) {
  if (py::isinstance<py::str>(chunks)) {
    const auto text = chunks.cast<std::string>();
    TORCH_CHECK_VALUE(text == "auto", "MC2Options: expected chunks_per_rank an int >= 1 or 'auto', got '",
                      text, "'");
    return tp::MC2Options::kAutoChunks;
  }
  TORCH_CHECK_TYPE(py::isinstance<py::int_>(chunks) && !py::isinstance<py::bool_>(chunks),
                   "MC2Options: expected chunks_per_rank an int >= 1 or 'auto', got ",
                   std::string(py::str(chunks.get_type().attr("__name__"))));
  const auto count = chunks.cast<int64_t>();
  TORCH_CHECK_VALUE(count >= 1, "MC2Options: expected chunks_per_rank an int >= 1 or 'auto', got ", count);
  return count;
}

void bind_contract(py::module& m) {
  py::class_<tp::MC2Options>(m, "MC2Options")
      .def(py::init([](const py::object& chunks, bool defer) {
             return tp::MC2Options().chunks_per_rank(chunks_from_python(chunks)).defer_weight_grads(defer);
           }),
           py::arg("chunks_per_rank") = "auto", py::kw_only(), py::arg("defer_weight_grads") = true)
      .def_property_readonly("chunks_per_rank",
                             [](const tp::MC2Options& o) -> py::object {
                               if (o.chunks_per_rank() == tp::MC2Options::kAutoChunks) return py::str("auto");
                               return py::int_(o.chunks_per_rank());
                             })
      .def_property_readonly("defer_weight_grads",
                             [](const tp::MC2Options& o) { return o.defer_weight_grads(); });
  py::class_<tp::MC2Contract>(m, "MC2Contract")
      .def_static("strict", &tp::MC2Contract::strict)
      .def_static("relaxed", &tp::MC2Contract::relaxed)
      .def_property_readonly("min_k", [](const tp::MC2Contract& c) { return c.min_k(); })
      .def_property_readonly("max_k", [](const tp::MC2Contract& c) { return c.max_k(); })
      .def_property_readonly("world_sizes", [](const tp::MC2Contract& c) { return c.world_sizes(); })
      .def_property_readonly("dtypes",
                             [](const tp::MC2Contract& c) {
                               py::list out;
                               for (auto d : c.dtypes()) out.append(dtype_object(d));
                               return out;
                             })
      .def("check_dtype", [](const tp::MC2Contract& c, const std::string& where,
                             const py::object& dtype) { c.check_dtype(where.c_str(), dtype_arg(dtype)); })
      .def("check_k", [](const tp::MC2Contract& c, const std::string& where, const std::string& what,
                         int64_t k) { c.check_k(where.c_str(), what.c_str(), k); })
      .def("check_world_size", [](const tp::MC2Contract& c, const std::string& where, int64_t ws) {
        c.check_world_size(where.c_str(), ws);
      });
  m.def("mc2_mode_from_string",
        [](const std::string& mode) { return tp::to_string(tp::mc2_mode_from_string(mode)); });
}

void bind_ops_and_layout(py::module& m) {
  m.def(
      "all_gather_matmul",
      [](const at::Tensor& x, const at::Tensor& w, py::handle g, const tp::MC2Options& o) {
        return tp::all_gather_matmul(x, w, group_arg(g), o);
      },
      py::arg("x"), py::arg("w"), py::arg("group"), py::arg("options") = tp::MC2Options());
  m.def(
      "matmul_reduce_scatter",
      [](const at::Tensor& x, const at::Tensor& w, py::handle g, const tp::MC2Options& o) {
        return tp::matmul_reduce_scatter(x, w, group_arg(g), o);
      },
      py::arg("x"), py::arg("w"), py::arg("group"), py::arg("options") = tp::MC2Options());
  m.def("sequence_rows", &tp::sequence_rows, py::arg("x"), py::arg("sequence_dim"));
  m.def("from_sequence_rows", &tp::from_sequence_rows, py::arg("rows"), py::arg("like"),
        py::arg("sequence_dim"), py::arg("seq_len"));
  m.def("normalize_sequence_dim", &tp::normalize_sequence_dim, py::arg("sequence_dim"),
        py::arg("ndim_leading"));
  m.def("move_dim_to_front", &tp::move_dim_to_front, py::arg("tensor"), py::arg("dim"));
  m.def("move_front_to_dim", &tp::move_front_to_dim, py::arg("tensor"), py::arg("dim"));
}

// The fused Linear's passes, each one call: MC2Linear's autograd nodes run the same functions.
void bind_fused_linear(py::module& m) {
  // The layout contract for the autograd Functions' gradients (autograd/gradient_layout.h).
  m.def(
      "gradient_in_layout",
      [](const std::optional<at::Tensor>& grad, std::vector<int64_t> sizes, std::vector<int64_t> strides) {
        return hyper_parallel::autograd::in_layout(
            or_undefined(grad), hyper_parallel::autograd::GradientLayout::of(sizes, strides));
      },
      py::arg("grad"), py::arg("sizes"), py::arg("strides"));
  m.def(
      "mc2_column_forward",
      [](const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, py::handle g,
         int64_t world_size, const tp::MC2Options& o) {
        const auto group = group_arg(g);
        tp::check_world_size_argument("AllGatherMatmulFunction", world_size, group);
        return tp::mc2_column_forward(x, w, or_undefined(bias), group, o);
      },
      py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("group"), py::arg("world_size"),
      py::arg("options") = tp::MC2Options());
  m.def("mc2_column_backward", [](const at::Tensor& dy, const std::optional<at::Tensor>& d_gathered,
                                  const at::Tensor& gathered, const at::Tensor& w, py::handle g,
                                  const tp::MC2Options& o, bool need_x, bool need_w, bool need_b) {
    return grads_tuple(tp::mc2_column_backward(dy, or_undefined(d_gathered), gathered, w, group_arg(g), o,
                                               {need_x, need_w, need_b}));
  });
  m.def(
      "mc2_row_forward",
      [](const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, py::handle g,
         int64_t world_size, const tp::MC2Options& o) {
        const auto group = group_arg(g);
        tp::check_world_size_argument("MatmulReduceScatterFunction", world_size, group);
        return tp::mc2_row_forward(x, w, or_undefined(bias), group, o);
      },
      py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("group"), py::arg("world_size"),
      py::arg("options") = tp::MC2Options());
  m.def("mc2_row_backward", [](const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, py::handle g,
                               const tp::MC2Options& o, bool need_x, bool need_w, bool need_b) {
    return grads_tuple(tp::mc2_row_backward(dy, x, w, group_arg(g), o, {need_x, need_w, need_b}));
  });
}

void bind_linear(py::module& m) {
  // The state and forward of an MC2Linear (the Python MC2Linear, a torch.nn.Linear, holds one).
  py::class_<tp::MC2Linear>(m, "MC2LinearState")
      .def(py::init(&tp::MC2Linear::standalone))
      .def(
          "configure_mc2",
          [](const tp::MC2Linear& l, const std::string& mode, py::handle g, int64_t world_size,
             int64_t sequence_dim, const tp::MC2Contract& contract, const tp::MC2Options& options) {
            l.configure_mc2(tp::mc2_mode_from_string(mode), group_arg(g), world_size, sequence_dim, contract,
                            options);
          },
          py::arg("mode"), py::arg("group"), py::arg("world_size"), py::arg("sequence_dim"),
          py::arg("contract"), py::arg("options"))
      .def("set_label", &tp::MC2Linear::set_label, py::arg("label"))
      .def("forward",
           [](const tp::MC2Linear& l, const at::Tensor& x, const at::Tensor& w,
              const std::optional<at::Tensor>& bias) { return l.forward(x, w, or_undefined(bias)); })
      .def_property_readonly("is_configured", &tp::MC2Linear::is_configured)
      .def_property_readonly("mode",
                             [](const tp::MC2Linear& l) -> py::object {
                               if (!l.is_configured()) return py::none();
                               return py::str(tp::to_string(l.mode()));
                             })
      .def_property_readonly("world_size",
                             [](const tp::MC2Linear& l) -> py::object {
                               return l.is_configured() ? py::cast(l.world_size()) : py::none();
                             })
      .def_property_readonly("sequence_dim", [](const tp::MC2Linear& l) -> py::object {
        return l.is_configured() ? py::cast(l.sequence_dim()) : py::none();
      });
}

// The two MC2 styles take the same options (their own options type each).
template <typename Style, typename Options>
void bind_mc2_style(py::module& m, const char* name) {
  py::class_<Style, tp::MC2Style, std::shared_ptr<Style>>(m, name).def(
      py::init([](dtensor::Placement in, dtensor::Placement out, bool local, tp::MC2Contract c,
                  tp::MC2Options o) {
        return Style(
            Options().input_layouts(in).output_layouts(out).use_local_output(local).contract(c).mc2_options(
                o));
      }),
      py::arg("input_layouts"), py::arg("output_layouts"), py::arg("use_local_output"), py::arg("contract"),
      py::arg("mc2_options"));
}

void bind_styles(py::module& m) {
  py::class_<tp::MC2Style, tp::ParallelStyle, std::shared_ptr<tp::MC2Style>>(m, "MC2Style")
      .def_property_readonly("mc2_mode", [](const tp::MC2Style& s) { return tp::to_string(s.mc2_mode()); })
      .def_property_readonly("sequence_dim", &tp::MC2Style::sequence_dim)
      .def("prepare_input", &tp::MC2Style::prepare_input)
      .def("prepare_output", &tp::MC2Style::prepare_output, py::arg("output"), py::arg("mesh"),
           py::arg("features") = py::none());
  bind_mc2_style<tp::MC2ColwiseParallel, tp::MC2ColwiseParallelOptions>(m, "MC2ColwiseParallel");
  bind_mc2_style<tp::MC2RowwiseParallel, tp::MC2RowwiseParallelOptions>(m, "MC2RowwiseParallel");
}

}  // namespace

void bind_mc2(py::module& m) {
  bind_contract(m);
  bind_ops_and_layout(m);
  bind_fused_linear(m);
  bind_linear(m);
  bind_styles(m);
}

}  // namespace hp_python
