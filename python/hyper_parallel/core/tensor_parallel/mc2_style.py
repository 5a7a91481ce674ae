"""MC2ColwiseParallel / MC2RowwiseParallel: ColwiseParallel / RowwiseParallel under sequence
parallelism with the collective fused into the matmul (an MC2Linear). Weights are sharded as the
plain styles shard them; the input is not redistributed to Replicate: the fused op gathers.

The layouts are checked when a style is made and the kernel contract when it is applied, by the
C++ core, so the messages and exception types are the C++ library's: ValueError for layouts and
limits, TypeError for a module that is not a Linear, NotImplementedError for an Embedding (its
kind is checked before anything else).
"""

from typing import Optional

from hyper_parallel import _C
from hyper_parallel.core.dtensor.placement_types import Placement, Shard
from hyper_parallel.core.tensor_parallel.mc2 import MC2Contract, MC2Linear, MC2Options
from hyper_parallel.core.tensor_parallel.style import (
    ColwiseParallel,
    RowwiseParallel,
    _replace_first_input,
    _shard_module,
)


def _apply_mc2(style, core, module, device_mesh):
    """Shards the Linear, converts it into a configured MC2Linear and installs the hooks."""
    _shard_module(core, module, device_mesh, style.src_data_rank)
    MC2Linear.from_linear(module).configure_mc2(core.mc2_mode, device_mesh.get_group(), device_mesh.size(),
                                                core.sequence_dim, contract=style.contract,
                                                options=style.mc2_options)
    module.register_forward_pre_hook(_replace_first_input(lambda x: core.prepare_input(x, device_mesh)))
    module.register_forward_hook(lambda m, args, y: core.prepare_output(y, device_mesh))
    return module


class MC2ColwiseParallel(ColwiseParallel):
    """ColwiseParallel whose input stays sequence-sharded (default Shard(1)): the MC2Linear
    all-gathers it inside its matmul."""

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

    def _core(self):
        return _C.MC2ColwiseParallel(self.input_layouts[0], self.output_layouts[0], self.use_local_output,
                                     self.contract, self.mc2_options)

    def apply(self, module, device_mesh):
        return _apply_mc2(self, self._core(), module, device_mesh)


class MC2RowwiseParallel(RowwiseParallel):
    """RowwiseParallel whose output is sequence-sharded (default Shard(1)): the MC2Linear
    reduce-scatters inside its matmul."""

    def __init__(self, *, input_layouts: Optional[Placement] = None, output_layouts: Optional[Placement] = None,
                 reduce_dtype=None, use_local_output: bool = True, contract: Optional[MC2Contract] = None,
                 mc2_options: Optional[MC2Options] = None):
        self.contract = contract or MC2Contract.strict()
        self.mc2_options = mc2_options or MC2Options()
        super().__init__(input_layouts=input_layouts,
                         output_layouts=output_layouts if output_layouts is not None else Shard(1),
                         use_local_output=use_local_output, reduce_dtype=reduce_dtype)

    def _core(self):
        return _C.MC2RowwiseParallel(self.input_layouts[0], self.output_layouts[0], self.use_local_output,
                                     self.contract, self.mc2_options)

    def apply(self, module, device_mesh):
        return _apply_mc2(self, self._core(), module, device_mesh)


__all__ = ["MC2ColwiseParallel", "MC2RowwiseParallel"]
