#pragma once
// hyper_parallel._C: the C++ core bound for Python, one bind_<layer> function per layer (as
// torch's csrc does). Nothing here computes: every function forwards to the library's public
// API, so each message and each rule exists once, in C++. User errors keep their Python type
// (c10::ValueError -> ValueError, c10::TypeError -> TypeError, c10::NotImplementedError ->
// NotImplementedError).
//
// Groups cross the boundary as torch.distributed ProcessGroups: every function that takes a
// group accepts one (the core adopts it, comm::adopt_group) or the core's own Group, and every
// group handed back is the ProcessGroup object torch made. The binding names c10d's types only
// to pass them through.

#include <torch/extension.h>

#include <hyper_parallel/hyper_parallel.h>

namespace hp_python {

namespace py = pybind11;
namespace comm = hyper_parallel::comm;
namespace dtensor = hyper_parallel::dtensor;
namespace tp = hyper_parallel::tensor_parallel;
namespace hpnn = hyper_parallel::nn;

void bind_comm(py::module& m);
void bind_dtensor(py::module& m);
void bind_tensor_parallel(py::module& m);
void bind_mc2(py::module& m);
void bind_data_parallel(py::module& m);
void bind_fully_shard(py::module& m);
void bind_checkpoint(py::module& m);

/// A group argument: the core's Group, or a torch.distributed ProcessGroup (adopted, joining
/// torch's world first if needed). Anything else is a TypeError naming what was passed.
comm::Group group_arg(const py::handle& group);
/// The ProcessGroup object a group runs on (for adopted groups: the one torch made).
py::object group_object(const comm::Group& group);

at::ScalarType dtype_arg(const py::handle& dtype);
py::object dtype_object(at::ScalarType dtype);
/// "linear", "embedding" or anything else ("other").
hpnn::ModuleKind module_kind_arg(const std::string& kind);

}  // namespace hp_python
