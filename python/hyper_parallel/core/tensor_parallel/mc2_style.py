"""MC2ColwiseParallel / MC2RowwiseParallel: ColwiseParallel / RowwiseParallel under sequence
parallelism with the collective fused into the matmul (an MC2Linear). Weights are sharded as the
plain styles shard them; the input is not redistributed to Replicate: the fused op gathers.

The layouts are checked when a style is made and the kernel contract when it is applied, by the
C++ core, so the messages and exception types are the C++ library's: ValueError for layouts and
limits, TypeError for a module that is not a Linear, NotImplementedError for an Embedding.
"""

from typing import Optional

import torch
from torch import nn

from hyper_parallel import _C
from hyper_parallel.core.dtensor.placement_types import Placement, Replicate, Shard
from hyper_parallel.core.tensor_parallel.mc2 import MC2Contract, MC2Linear, MC2Options
from hyper_parallel.core.tensor_parallel.style import ColwiseParallel, RowwiseParallel, _claim, _replace_first_input, _shard


def _kind(module: nn.Module) -> str:
    return "linear" if isinstance(module, nn.Linear) else "embedding" if isinstance(module, nn.Embedding) else "other"


def _check_target(checks, module, mesh) -> None:
    weight = getattr(module, "weight", None)
    shape = list(weight.shape) if weight is not None else []
    checks.check_target(_kind(module), type(module).__name__, shape,
                        weight.dtype if weight is not None else torch.float32, mesh)


class MC2ColwiseParallel(ColwiseParallel):
    """ColwiseParallel whose input stays sequence-sharded (default Shard(1)): the MC2Linear
    all-gathers it inside its matmul."""

    def __init__(self, *, input_layouts: Optional[Placement] = None, output_layouts: Optional[Placement] = None,
                 use_local_output: bool = True, contract: Optional[MC2Contract] = None,
                 mc2_options: Optional[MC2Options] = None):
        super().__init__(input_layouts=input_layouts if input_layouts is not None else Shard(1),
                         output_layouts=output_layouts, use_local_output=use_local_output)
        self.contract = contract or MC2Contract.strict()
        self.mc2_options = mc2_options or MC2Options()
        self._checks = _C.MC2ColwiseParallelChecks(self.input_layouts, self.output_layouts, use_local_output,
                                                   self.contract, self.mc2_options)

    def _apply(self, module, device_mesh):
        name, mesh, layout = type(self).__name__, device_mesh, self.input_layouts
        _check_target(self._checks, module, mesh)
        _claim(name, module)
        _shard(module.weight, mesh, [Shard(0)], self.src_data_rank)
        _shard(module.bias, mesh, [Shard(0)], self.src_data_rank)
        MC2Linear.from_linear(module).configure_mc2("all_gather", mesh.get_group(0), mesh.size(0), layout.dim,
                                                    self.contract, self.mc2_options)
        module.register_forward_pre_hook(
            _replace_first_input(lambda x: _C.sequence_sharded_input(name, x, mesh, layout)))
        out, local = self.output_layouts, self.use_local_output
        module.register_forward_hook(lambda m, args, y: _C.prepare(y, mesh, Shard(-1), out, local))
        return module


class MC2RowwiseParallel(RowwiseParallel):
    """RowwiseParallel whose output is sequence-sharded (default Shard(1)): the MC2Linear
    reduce-scatters inside its matmul."""

    def __init__(self, *, input_layouts: Optional[Placement] = None, output_layouts: Optional[Placement] = None,
                 use_local_output: bool = True, contract: Optional[MC2Contract] = None,
                 mc2_options: Optional[MC2Options] = None):
        super().__init__(input_layouts=input_layouts,
                         output_layouts=output_layouts if output_layouts is not None else Shard(1),
                         use_local_output=use_local_output)
        self.contract = contract or MC2Contract.strict()
        self.mc2_options = mc2_options or MC2Options()
        self._checks = _C.MC2RowwiseParallelChecks(self.input_layouts, self.output_layouts, use_local_output,
                                                   self.contract, self.mc2_options)

    def _apply(self, module, device_mesh):
        name, mesh = type(self).__name__, device_mesh
        _check_target(self._checks, module, mesh)
        _claim(name, module)
        _shard(module.weight, mesh, [Shard(1)], self.src_data_rank)
        # The fused backward gathers dY, so the bias gradient is complete on every rank.
        _shard(module.bias, mesh, [Replicate()], self.src_data_rank)
        out, layout = self.output_layouts, self.input_layouts
        MC2Linear.from_linear(module).configure_mc2("reduce_scatter", mesh.get_group(0), mesh.size(0), out.dim,
                                                    self.contract, self.mc2_options)
        module.register_forward_pre_hook(
            _replace_first_input(lambda x: _C.prepare(x, mesh, layout, Shard(x.dim() - 1), True)))
        local = self.use_local_output
        module.register_forward_hook(lambda m, args, y: _C.prepare(y, mesh, out, out, local))
        return module
