// core/tensor_parallel: the plan rules, the parameter tables and operations, and the plain
// styles, whose hook methods the Python styles install on torch.nn modules.
#include <optional>

#include <torch/csrc/Exceptions.h>

#include "bindings.h"

namespace hp_python {
namespace {

// torch's reduction enum (torch.nn._reduction.get_enum): 0 none, 1 mean, 2 sum.
tp::LossReduction reduction_arg(const char* fn, int64_t reduction) {
  TORCH_CHECK_VALUE(reduction >= 0 && reduction <= 2, fn,
                    ": expected reduction 0 (none), 1 (mean) or 2 (sum), got ", reduction);
  const tp::LossReduction reductions[] = {tp::LossReduction::kNone, tp::LossReduction::kMean,
                                          tp::LossReduction::kSum};
  return reductions[reduction];
}

using Layouts = std::vector<std::optional<dtensor::Placement>>;

tp::ModuleTarget target_arg(const std::string& kind, const std::string& type,
                            std::vector<int64_t> weight_shape, const py::handle& weight_dtype) {
  return {module_kind_arg(kind), type, std::move(weight_shape),
          weight_dtype.is_none() ? at::kFloat : dtype_arg(weight_dtype)};
}

// Python positional arguments as tensors (anything else as undefined), and back.
std::vector<at::Tensor> tensors_of(const py::sequence& values) {
  std::vector<at::Tensor> tensors;
  for (const auto& v : values)
    tensors.push_back(THPVariable_Check(v.ptr()) ? v.cast<at::Tensor>() : at::Tensor());
  return tensors;
}

py::tuple merge(const py::sequence& values, const std::vector<at::Tensor>& tensors) {
  py::tuple out(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    out[i] = tensors[i].defined() ? py::cast(tensors[i]) : py::reinterpret_borrow<py::object>(values[i]);
  }
  return out;
}

void bind_plan(py::module& m) {
  m.def("check_tp_mesh", &tp::check_tp_mesh, py::arg("where"), py::arg("mesh"));
  m.def(
      "match_plan",
      [](const std::vector<std::pair<std::string, std::string>>& plan,
         const std::vector<std::string>& module_paths, const std::string& root_name) {
        // The handler turns the core's TORCH_WARN into Python warnings.
        HANDLE_TH_ERRORS
        std::vector<tp::PlanEntry> entries;
        for (const auto& [key, style] : plan) entries.push_back({key, style});
        std::vector<std::pair<size_t, std::string>> targets;
        for (const auto& t : tp::match_plan(entries, module_paths, root_name))
          targets.emplace_back(t.entry, t.fqn);
        return targets;
        END_HANDLE_TH_ERRORS_PYBIND
      },
      py::arg("plan"), py::arg("module_paths"), py::arg("root_name"),
      "(entry index, module path) for every module each (key, style name) entry matches; warns for a key "
      "matching nothing and for an empty plan.");
  m.def(
      "describe_target",
      [](const std::string& fqn, const std::string& style,
         const std::vector<std::tuple<std::string, py::object, std::vector<int64_t>>>& params) {
        std::vector<tp::ParameterDescription> described;
        for (const auto& [name, dtype, shape] : params) described.push_back({name, dtype_arg(dtype), shape});
        return tp::describe_target(fqn, style, described);
      },
      py::arg("fqn"), py::arg("style"), py::arg("parameters"));
  m.def("check_plan_agrees", &tp::check_plan_agrees, py::arg("lines"), py::arg("mesh"));
}

void bind_parameters(py::module& m) {
  m.def(
      "layout_of",
      [](const at::Tensor& param) -> py::object {
        const auto layout = hpnn::recorded_layout(param);
        if (!layout) return py::none();
        return py::make_tuple(layout->mesh, layout->placements, layout->global_shape);
      },
      py::arg("param"), "(mesh, placements, global shape) as the parameter's style recorded it, or None.");
  m.def(
      "full_tensor",
      [](const at::Tensor& param, const std::optional<at::Tensor>& value) {
        return value ? tp::full_tensor(param, *value) : tp::full_tensor(param);
      },
      py::arg("param"), py::arg("value") = py::none());
  m.def("clip_grad_norm_", py::overload_cast<const std::vector<at::Tensor>&, double>(&tp::clip_grad_norm_),
        py::arg("parameters"), py::arg("max_norm"));
  m.def("grad_norm", &tp::grad_norm, py::arg("parameters"));
  m.def(
      "vocab_parallel_cross_entropy",
      [](const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_size,
         const dtensor::DeviceMesh& mesh, int64_t ignore_index, int64_t reduction, double label_smoothing) {
        return tp::vocab_parallel_cross_entropy(
            logits, targets, vocab_size, mesh,
            tp::CrossEntropyOptions()
                .ignore_index(ignore_index)
                .reduction(reduction_arg("vocab_parallel_cross_entropy", reduction))
                .label_smoothing(label_smoothing));
      },
      py::arg("local_logits"), py::arg("targets"), py::arg("vocab_size"), py::arg("mesh"),
      py::arg("ignore_index") = -100, py::arg("reduction") = 1, py::arg("label_smoothing") = 0.0);
  m.def("vocab_parallel_log_softmax", &tp::vocab_parallel_log_softmax, py::arg("local_logits"),
        py::arg("vocab_size"), py::arg("mesh"));
  m.def(
      "vocab_parallel_nll_loss",
      [](const at::Tensor& input, const at::Tensor& targets, int64_t vocab_size,
         const dtensor::DeviceMesh& mesh, int64_t ignore_index, int64_t reduction) {
        return tp::vocab_parallel_nll_loss(input, targets, vocab_size, mesh,
                                           reduction_arg("vocab_parallel_nll_loss", reduction), ignore_index);
      },
      py::arg("local_input"), py::arg("targets"), py::arg("vocab_size"), py::arg("mesh"),
      py::arg("ignore_index") = -100, py::arg("reduction") = 1);
  m.def("untraced_vocab_shard_source", &tp::untraced_vocab_shard_source, py::arg("t"));
  m.def("local_vocab_shard_source", &tp::local_vocab_shard_source, py::arg("t"));
  m.def(
      "lay_out_parameters",
      [](const tp::ParallelStyle& style, const std::string& kind, const std::string& type,
         const std::vector<std::pair<std::string, at::Tensor>>& parameters,
         const std::optional<std::string>& claimed_by, const dtensor::DeviceMesh& mesh,
         std::optional<int64_t> src_data_rank) {
        // The target's weight is the module's own parameter "weight", as target_of reads it.
        auto target = target_arg(kind, type, {}, py::none());
        for (const auto& [name, value] : parameters) {
          if (name != "weight") continue;
          target.weight_shape = value.sizes().vec();
          target.weight_dtype = value.scalar_type();
        }
        return tp::lay_out_parameters(style, target, parameters, claimed_by, mesh, src_data_rank,
                                      tp::ModuleTypeNames::torch_nn());
      },
      py::arg("style"), py::arg("kind"), py::arg("module_type"), py::arg("parameters"), py::arg("claimed_by"),
      py::arg("mesh"), py::arg("src_data_rank"),
      "The core's apply preamble for a torch.nn module: its checks, then its parameters laid out in place. "
      "Returns the names of those whose forward reads must go through sum_gradient_on_read.");
  m.def("sum_gradient_on_read", &tp::sum_gradient_on_read, py::arg("read"), py::arg("mesh"),
        "What a module computes with for a replicated parameter whose forward gradient is Partial: "
        "that gradient is summed over the mesh in backward, other gradients of the parameter are not.");
}

void bind_style_base(py::module& m) {
  py::class_<tp::ParallelStyle, std::shared_ptr<tp::ParallelStyle>>(m, "ParallelStyleCore")
      .def("name", &tp::ParallelStyle::name)
      .def(
          "check_kind",
          [](const tp::ParallelStyle& s, const std::string& kind, const std::string& type) {
            s.check_kind(target_arg(kind, type, {}, py::none()), tp::ModuleTypeNames::torch_nn());
          },
          py::arg("kind"), py::arg("module_type"));
}

void bind_plain_styles(py::module& m) {
  using tp::ParallelStyle;
  py::class_<tp::ColwiseParallel, ParallelStyle, std::shared_ptr<tp::ColwiseParallel>>(m, "ColwiseParallel")
      .def(py::init([](dtensor::Placement in, dtensor::Placement out, bool local) {
             return tp::ColwiseParallel(
                 tp::ColwiseParallelOptions().input_layouts(in).output_layouts(out).use_local_output(local));
           }),
           py::arg("input_layouts"), py::arg("output_layouts"), py::arg("use_local_output"))
      .def("prepare_input",
           [](const tp::ColwiseParallel& s, const at::Tensor& x, const std::string& kind,
              const dtensor::DeviceMesh& mesh) { return s.prepare_input(x, module_kind_arg(kind), mesh); })
      .def("prepare_output", &tp::ColwiseParallel::prepare_output, py::arg("output"), py::arg("mesh"),
           py::arg("features") = std::nullopt);
  py::class_<tp::RowwiseParallel, ParallelStyle, std::shared_ptr<tp::RowwiseParallel>>(m, "RowwiseParallel")
      .def(py::init([](dtensor::Placement in, dtensor::Placement out, bool local) {
             return tp::RowwiseParallel(
                 tp::RowwiseParallelOptions().input_layouts(in).output_layouts(out).use_local_output(local));
           }),
           py::arg("input_layouts"), py::arg("output_layouts"), py::arg("use_local_output"))
      .def("prepare_input", &tp::RowwiseParallel::prepare_input)
      .def("forward_linear",
           [](const tp::RowwiseParallel& s, const at::Tensor& x, const at::Tensor& w,
              const std::optional<at::Tensor>& b, const dtensor::DeviceMesh& mesh) {
             return s.forward_linear(x, w, b.value_or(at::Tensor()), mesh);
           })
      .def("forward_embedding", &tp::RowwiseParallel::forward_embedding, py::arg("ids"), py::arg("weight"),
           py::arg("vocab_size"), py::arg("mesh"), py::arg("padding_idx") = std::nullopt);
  py::class_<tp::SequenceParallel, ParallelStyle, std::shared_ptr<tp::SequenceParallel>>(m,
                                                                                         "SequenceParallel")
      .def(py::init([](int64_t seq, bool local) {
             return tp::SequenceParallel(
                 tp::SequenceParallelOptions().sequence_dim(seq).use_local_output(local));
           }),
           py::arg("sequence_dim"), py::arg("use_local_output"))
      .def("prepare_inputs",
           [](const tp::SequenceParallel& s, const py::sequence& args, const dtensor::DeviceMesh& mesh) {
             return merge(args, s.prepare_inputs(tensors_of(args), mesh));
           })
      .def("prepare_output", &tp::SequenceParallel::prepare_output);
}

void bind_prepare_styles(py::module& m) {
  using tp::ParallelStyle;
  py::class_<tp::PrepareModuleInput, ParallelStyle, std::shared_ptr<tp::PrepareModuleInput>>(
      m, "PrepareModuleInput")
      .def(py::init([](Layouts in, Layouts desired, bool local) {
             return tp::PrepareModuleInput(tp::PrepareModuleInputOptions()
                                               .input_layouts(in)
                                               .desired_input_layouts(desired)
                                               .use_local_output(local));
           }),
           py::arg("input_layouts"), py::arg("desired_input_layouts"), py::arg("use_local_output"))
      .def("prepare_inputs",
           [](const tp::PrepareModuleInput& s, const py::sequence& args, const dtensor::DeviceMesh& mesh) {
             return merge(args, s.prepare_inputs(tensors_of(args), mesh));
           });
  py::class_<tp::PrepareModuleOutput, ParallelStyle, std::shared_ptr<tp::PrepareModuleOutput>>(
      m, "PrepareModuleOutput")
      .def(py::init([](Layouts out, Layouts desired, bool local) {
             return tp::PrepareModuleOutput(tp::PrepareModuleOutputOptions()
                                                .output_layouts(out)
                                                .desired_output_layouts(desired)
                                                .use_local_output(local));
           }),
           py::arg("output_layouts"), py::arg("desired_output_layouts"), py::arg("use_local_output"))
      .def("prepare_outputs",
           [](const tp::PrepareModuleOutput& s, const py::sequence& outs, const dtensor::DeviceMesh& mesh) {
             return merge(outs, s.prepare_outputs(tensors_of(outs), mesh));
           });
}

}  // namespace

void bind_tensor_parallel(py::module& m) {
  bind_plan(m);
  bind_parameters(m);
  bind_style_base(m);
  bind_plain_styles(m);
  bind_prepare_styles(m);
}

}  // namespace hp_python
