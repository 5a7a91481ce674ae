"""MC2ColwiseParallel / MC2RowwiseParallel: ColwiseParallel / RowwiseParallel under sequence
parallelism with the collective fused into the matmul (an MC2Linear). As in the original, a
style's ``apply`` converts the ``nn.Linear`` into a configured MC2Linear in place (it needs only
``mesh.get_group()`` and ``mesh.size()``), then runs the base style's ``apply``, which shards the
weights as the plain style does; the input is not redistributed to Replicate: the fused op
gathers.

The layouts are checked when a style is made, the module's kind first at apply, the kernel's
shape and world-size limits at apply (a cast cannot change them) and its dtype limit when a
layer runs (so a model parallelized in float32 and then cast to bfloat16 works), all by the C++
core, so the messages and exception types are the C++ library's: ValueError for layouts and
limits, TypeError for a module that is not a Linear, NotImplementedError for an Embedding.
"""

from typing import Optional

from torch import nn

from hyper_parallel import _C
from hyper_parallel.core.dtensor.placement_types import Placement, Shard
from hyper_parallel.core.tensor_parallel.mc2 import MC2Contract, MC2Linear, MC2Options
from hyper_parallel.core.tensor_parallel.style import (
    ColwiseParallel,
    RowwiseParallel,
    _check_own_forward,
    _module_kind,
    _replace_first_input,
)

__all__ = ["MC2ColwiseParallel", "MC2RowwiseParallel"]


def _apply_mc2(style, module: nn.Module, device_mesh, base_apply):
    """The module's kind checked; the Linear converted in place into an MC2Linear configured with
    the mesh's group (kept as given: resolved when the layer first runs) and size; then the base
    style's apply. On an error the module is left as it was."""
    core = style._core()
    core.check_kind(_module_kind(module), type(module).__name__)
    if type(module).forward is not MC2Linear.forward:  # the MC2Linear's forward replaces the module's
        _check_own_forward(type(style).__name__, module, nn.Linear)
    original = type(module)
    linear = MC2Linear.from_linear(module)
    try:
        linear.configure_mc2(core.mc2_mode, device_mesh.get_group(), device_mesh.size(), core.sequence_dim,
                             contract=style.contract, options=style.mc2_options)
        return base_apply(linear, device_mesh)
    except Exception:
        if original is not MC2Linear:
            linear.__class__ = original
            del linear._mc2_config, linear._mc2
        raise


def _install_mc2_hooks(style, core, module, kind, mesh):  # pylint: disable=unused-argument
    """The input hook (the fused op's input layout) and the output hook (its output tagged or
    redistributed to output_layouts); the MC2Linear's own forward runs the fused op."""
    module.register_forward_pre_hook(_replace_first_input(type(style).__name__, lambda x: core.prepare_input(x, mesh)))
    module.register_forward_hook(lambda m, args, y: core.prepare_output(y, mesh, m.out_features))


class MC2ColwiseParallel(ColwiseParallel):
    """ColwiseParallel whose input stays sequence-sharded (default Shard(1)): the MC2Linear
    all-gathers it inside its matmul. ``_sequence_dim`` is the input layout's Shard dim."""

    def __init__(self, *, input_layouts: Optional[Placement] = None, output_layouts: Optional[Placement] = None,
                 use_local_output: Optional[bool] = True, contract: Optional[MC2Contract] = None,
                 mc2_options: Optional[MC2Options] = None):
        self.contract = contract or MC2Contract.strict()
        self.mc2_options = mc2_options or MC2Options()
        super().__init__(input_layouts=input_layouts if input_layouts is not None else Shard(1),
                         output_layouts=output_layouts,
                         use_local_output=True if use_local_output is None else use_local_output)
        # The fused op gathers: the input keeps its sequence sharding.
        self.desired_input_layouts = self.input_layouts
        self._sequence_dim = self.input_layouts[0].dim

    def _core(self):
        return _C.MC2ColwiseParallel(self.input_layouts[0], self.output_layouts[0], self.use_local_output,
                                     self.contract, self.mc2_options)

    def apply(self, module, device_mesh):
        return _apply_mc2(self, module, device_mesh, super().apply)

    _install_hooks = _install_mc2_hooks


class MC2RowwiseParallel(RowwiseParallel):
    """RowwiseParallel whose output is sequence-sharded (default Shard(1)): the MC2Linear
    reduce-scatters inside its matmul. ``_sequence_dim`` is the output layout's Shard dim."""

    def __init__(self, *, input_layouts: Optional[Placement] = None, output_layouts: Optional[Placement] = None,
                 reduce_dtype=None, use_local_output: bool = True, contract: Optional[MC2Contract] = None,
                 mc2_options: Optional[MC2Options] = None):
        self.contract = contract or MC2Contract.strict()
        self.mc2_options = mc2_options or MC2Options()
        super().__init__(input_layouts=input_layouts,
                         output_layouts=output_layouts if output_layouts is not None else Shard(1),
                         use_local_output=use_local_output, reduce_dtype=reduce_dtype)
        self._sequence_dim = self.output_layouts[0].dim

    def _core(self):
        return _C.MC2RowwiseParallel(self.input_layouts[0], self.output_layouts[0], self.use_local_output,
                                     self.contract, self.mc2_options)

    def apply(self, module, device_mesh):
        return _apply_mc2(self, module, device_mesh, super().apply)

    # The MC2Linear's own forward reduce-scatters: no row-parallel forward replaces it.
    _install_hooks = _install_mc2_hooks
