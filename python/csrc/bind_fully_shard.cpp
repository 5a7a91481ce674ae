// fully_shard: the C++ core's parameter group, which the Python fully_shard drives from
// torch.nn modules' forward hooks. The gathering, the differentiable views, the pre-backward
// nodes and the reduce-scatter node are C++; a Python backward() runs them without the GIL.
#include <optional>

#include "bindings.h"

namespace hp_python {

namespace fs = hyper_parallel::fully_shard;

namespace {

std::optional<at::ScalarType> optional_dtype(const py::object& dtype) {
  if (dtype.is_none()) return std::nullopt;
  return dtype_arg(dtype);
}

using GroupClass = py::class_<fs::ParamGroup, std::shared_ptr<fs::ParamGroup>>;

fs::ParamGroup::Caller caller(bool sharded_module) {
  return sharded_module ? fs::ParamGroup::Caller::kShardedModule : fs::ParamGroup::Caller::kOwner;
}

// What the forward hooks call: a module's forward begins and ends, or raised; its outputs'
// pre-backward.
void bind_forward_calls(GroupClass& cls) {
  cls.def(
         "pre_forward",
         [](fs::ParamGroup& group, const std::optional<at::Tensor>& rows,
            const std::vector<std::shared_ptr<fs::ParamGroup>>& prefetch,
            bool sharded_module) -> const std::vector<at::Tensor>& {
           return group.pre_forward(
               rows.value_or(at::Tensor()),
               [&prefetch] {
                 for (const auto& g : prefetch) g->unshard(/*async_op=*/true);
               },
               caller(sharded_module));
         },
         py::arg("rows") = py::none(), py::arg("prefetch") = std::vector<std::shared_ptr<fs::ParamGroup>>(),
         py::kw_only(), py::arg("sharded_module") = false,
         "The gathered parameters (collective on the first call of a pass); rows: an embedding's ids; "
         "prefetch: groups whose gathers start then (not in a recomputation); sharded_module: the call "
         "is the forward of the module fully_shard was applied to (one whole pass), not an owning "
         "module's.")
      .def(
          "post_forward",
          [](fs::ParamGroup& group, bool sharded_module) {
            return group.post_forward(caller(sharded_module));
          },
          py::kw_only(), py::arg("sharded_module") = false,
          "Ends a pre_forward's call; True if it was the outermost open one (put the shards back).")
      .def("abandon_forward", &fs::ParamGroup::abandon_forward,
           "A forward of the group raised: its open calls are over.")
      .def(
          "register_pre_backward",
          [](fs::ParamGroup& group, std::vector<at::Tensor> outputs,
             const std::vector<std::shared_ptr<fs::ParamGroup>>& prefetch) {
            return group.register_pre_backward(std::move(outputs), [prefetch] {
              for (const auto& g : prefetch) g->unshard(/*async_op=*/true);
            });
          },
          py::arg("outputs"), py::arg("prefetch"))
      .def("backward_views", &fs::ParamGroup::backward_views,
           "Views of the gathered parameters for the owning modules to hold during the group's backward "
           "(empty: none to stand in).")
      .def("release_backward_views", &fs::ParamGroup::release_backward_views,
           "The module's backward is over: frees the buffers if the group's backward is over too.");
}

// Main gradients live where Python users read them: the parameter's main_grad attribute.
void keep_main_grads_on_parameters() {
  hpnn::set_main_grad_store({[](const at::Tensor& param) {
                               py::gil_scoped_acquire gil;
                               const auto held = py::getattr(py::cast(param), "main_grad", py::none());
                               if (held.is_none()) return at::Tensor();
                               TORCH_CHECK_TYPE(THPVariable_Check(held.ptr()),
                                                "fully_shard: expected a parameter's main_grad None or a "
                                                "tensor, got ",
                                                py::str(py::type::of(held)).cast<std::string>());
                               return held.cast<at::Tensor>();
                             },
                             [](const at::Tensor& param, at::Tensor grad) {
                               py::gil_scoped_acquire gil;
                               py::setattr(py::cast(param), "main_grad",
                                           grad.defined() ? py::cast(std::move(grad)) : py::none());
                             }});
}

}  // namespace

void bind_fully_shard(py::module& m) {
  keep_main_grads_on_parameters();
  GroupClass cls(m, "FullyShardParamGroup");
  cls.def(
      py::init([](std::vector<at::Tensor> params, std::vector<std::string> names,
                  const dtensor::DeviceMesh& mesh, bool reshard_after_forward, const py::object& param_dtype,
                  const py::object& reduce_dtype, bool offload_to_cpu, bool pin_memory,
                  std::optional<int64_t> reduce_bucket_cap_bytes, bool apply_grad_on_fp32_main_grad) {
        const auto options =
            fs::FullyShardOptions()
                .mesh(mesh)
                .reshard_after_forward(reshard_after_forward)
                .mp_policy(fs::MixedPrecisionPolicy()
                               .param_dtype(optional_dtype(param_dtype))
                               .reduce_dtype(optional_dtype(reduce_dtype))
                               .apply_grad_on_fp32_main_grad(apply_grad_on_fp32_main_grad))
                .offload_policy(fs::OffloadPolicy().offload_to_cpu(offload_to_cpu).pin_memory(pin_memory))
                .reduce_bucket_cap_bytes(
                    reduce_bucket_cap_bytes.value_or(fs::FullyShardOptions().reduce_bucket_cap_bytes()));
        return std::make_shared<fs::ParamGroup>(std::move(params), std::move(names), options);
      }),
      py::arg("params"), py::arg("names"), py::arg("mesh"), py::arg("reshard_after_forward"),
      py::arg("param_dtype"), py::arg("reduce_dtype"), py::arg("offload_to_cpu"), py::arg("pin_memory"),
      py::arg("reduce_bucket_cap_bytes") = py::none(), py::arg("apply_grad_on_fp32_main_grad") = false);
  bind_forward_calls(cls);
  cls.def("unshard", &fs::ParamGroup::unshard, py::arg("async_op") = false)
      .def("wait_for_unshard", &fs::ParamGroup::wait_for_unshard)
      .def_static(
          "share_pass_order",
          [](const std::vector<std::shared_ptr<fs::ParamGroup>>& groups) {
            std::vector<fs::ParamGroup*> raw;
            for (const auto& g : groups) raw.push_back(g.get());
            fs::ParamGroup::share_pass_order(raw);
          },
          py::arg("groups"))
      .def_property_readonly("gather_stats",
                             [](const fs::ParamGroup& g) {
                               const auto s = g.gather_stats();
                               py::dict d;
                               d["gathers"] = s.gathers;
                               d["prefetched"] = s.prefetched;
                               d["regathered"] = s.regathered;
                               return d;
                             })
      .def("reshard", &fs::ParamGroup::reshard)
      .def_property_readonly("is_unsharded", &fs::ParamGroup::is_unsharded)
      .def("set_users", &fs::ParamGroup::set_users, py::arg("users"))
      .def("set_requires_gradient_sync", &fs::ParamGroup::set_requires_gradient_sync, py::arg("sync"))
      .def("set_requires_all_reduce", &fs::ParamGroup::set_requires_all_reduce, py::arg("all_reduce"))
      .def("set_reshard_after_forward", &fs::ParamGroup::set_reshard_after_forward, py::arg("reshard"))
      .def("set_reshard_after_backward", &fs::ParamGroup::set_reshard_after_backward, py::arg("reshard"))
      .def("set_row_sparse_gradients", &fs::ParamGroup::set_row_sparse_gradients, py::arg("row_sparse"))
      .def("set_gradient_scaling_factor", &fs::ParamGroup::set_gradient_scaling_factor, py::arg("factor"))
      .def("set_reduce_op", &fs::ParamGroup::set_reduce_op, py::arg("op"))
      .def("set_gradient_divide_factor", &fs::ParamGroup::set_gradient_divide_factor, py::arg("factor"))
      .def_static("check_gradient_divide_factor", &fs::ParamGroup::check_gradient_divide_factor,
                  py::arg("factor"))
      .def("index_of", &fs::ParamGroup::index_of, py::arg("param"))
      .def("adopt_parameter", &fs::ParamGroup::adopt_parameter, py::arg("index"), py::arg("param"),
           "Parameter index becomes param, a new tensor a conversion made for it (to_empty from meta).")
      .def_property_readonly("parameters", &fs::ParamGroup::parameters)
      .def_static("is_managed", &fs::ParamGroup::is_managed, py::arg("param"));
}

}  // namespace hp_python
