// checkpoint: states of named tensors and AdamW moments, and save / load / latest_step /
// export_full, the very C++ functions the C++ trainer calls, so both write the same files.
#include <optional>

#include <torch/csrc/Exceptions.h>

#include "bindings.h"

namespace hp_python {
namespace {

namespace ckpt = hyper_parallel::checkpoint;

void bind_state(py::module& m) {
  py::class_<ckpt::State>(m, "CheckpointState")
      .def(py::init<>())
      .def(
          "add_tensor",
          [](ckpt::State& s, const std::string& key, const at::Tensor& t) { s.add(key, ckpt::entry_of(t)); },
          py::arg("key"), py::arg("tensor"), "An entry aliasing `tensor`, laid out as its style recorded it.")
      .def(
          "add_adamw",
          [](ckpt::State& s, const std::string& fqn, const at::Tensor& param, const at::Tensor& exp_avg,
             const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
             const at::Tensor& step) {
            // torch.optim.AdamW keeps its step in a float tensor: an int64 on disk.
            ckpt::add_adamw_state(s, fqn, param,
                                  {exp_avg, exp_avg_sq, max_exp_avg_sq.value_or(at::Tensor()),
                                   [step] { return static_cast<int64_t>(step.item<double>()); },
                                   [step](int64_t v) { step.fill_(static_cast<double>(v)); }});
          },
          py::arg("fqn"), py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
          py::arg("max_exp_avg_sq"), py::arg("step"))
      .def("keys",
           [](const ckpt::State& s) {
             std::vector<std::string> keys;
             for (const auto& item : s) keys.push_back(item.first);
             return keys;
           })
      .def("__len__", &ckpt::State::size);
}

py::dict result_dict(const ckpt::SaveResult& r) {
  py::dict out;
  out["path"] = r.path;
  out["total_bytes"] = r.total_bytes;
  out["bytes_written"] = r.bytes_written;
  out["background_seconds"] = r.background_seconds;
  out["background_cpu_seconds"] = r.background_cpu_seconds;
  return out;
}

void bind_io(py::module& m) {
  m.def(
      "checkpoint_save",
      [](const std::string& root, const ckpt::State& state, int64_t step, bool fsync, bool asynchronous) {
        return result_dict(
            ckpt::save(root, state, ckpt::SaveOptions().step(step).fsync(fsync).asynchronous(asynchronous)));
      },
      py::arg("root"), py::arg("state"), py::arg("step"), py::arg("fsync") = true,
      py::arg("asynchronous") = false);
  m.def(
      "checkpoint_finish",
      []() -> std::optional<py::dict> {
        std::optional<ckpt::SaveResult> done;
        {
          py::gil_scoped_release release;  // the writer needs no Python; other threads may run
          done = ckpt::finish();
        }
        if (!done) return std::nullopt;
        return result_dict(*done);
      },
      "Waits for the asynchronous save in flight; raises its error. None if none was in flight.");
  m.def("checkpoint_save_in_flight", &ckpt::save_in_flight);
  m.def(
      "checkpoint_load",
      [](const std::string& dir, ckpt::State& state, bool strict, bool strict_dtype, bool collective) {
        // The handler turns the core's warning (a cast) into a Python warning.
        HANDLE_TH_ERRORS
        ckpt::load(dir, state,
                   ckpt::LoadOptions().strict(strict).strict_dtype(strict_dtype).collective(collective));
        END_HANDLE_TH_ERRORS_PYBIND
      },
      py::arg("dir"), py::arg("state"), py::arg("strict") = true, py::arg("strict_dtype") = false,
      py::arg("collective") = true);
  m.def(
      "checkpoint_abandon_load", [](const std::string& error) { ckpt::abandon_load(error); },
      py::arg("error"),
      "This rank's part of a collective load failed before it began: the other ranks raise it too.");
  m.def("checkpoint_latest_step", &ckpt::latest_step, py::arg("root"));
  m.def("checkpoint_step_dir", &ckpt::step_dir, py::arg("root"), py::arg("step"));
  m.def("checkpoint_export_full", &ckpt::export_full, py::arg("dir"), py::arg("out_file"));
}

}  // namespace

void bind_checkpoint(py::module& m) {
  bind_state(m);
  bind_io(m);
}

}  // namespace hp_python
