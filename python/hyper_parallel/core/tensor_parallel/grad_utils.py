"""Whole-model helpers that know which parameters are sharded: the layouts the styles recorded.
Parameters stay plain local tensors (the optimizer sees its shard and stays fast), so, unlike
PyTorch's DTensor parameters, ``isinstance(p, DTensor)`` is False and there is no
``p.full_tensor()`` method: ``layout_of(p)`` and ``full_tensor(p)`` give the global view."""

from typing import Iterable, NamedTuple, Optional, Tuple

import torch

from hyper_parallel import _C
from hyper_parallel.core.dtensor.placement_types import Placement, as_python

__all__ = ["ParameterLayout", "clip_grad_norm_", "full_tensor", "layout_of"]


class ParameterLayout(NamedTuple):
    mesh: _C.DeviceMesh
    placements: Tuple[Placement, ...]
    global_shape: Tuple[int, ...]


def layout_of(param: torch.Tensor) -> Optional[ParameterLayout]:
    """How a style laid ``param`` out (mesh, placements, global shape); None if none did."""
    layout = _C.layout_of(param)
    if layout is None:
        return None
    mesh, placements, shape = layout
    return ParameterLayout(mesh, tuple(as_python(p) for p in placements), tuple(shape))


def full_tensor(param: torch.Tensor, value: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The full value of ``param`` (gathered over its mesh: collective), or a copy if unsharded;
    with ``value`` (e.g. ``param.grad``), the full value of that tensor laid out as ``param``."""
    return _C.full_tensor(param, value)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clips the gradients by the global parameters' L2 norm, computed by the C++ core: sharded
    parameters' squared norms are summed over their mesh, replicated ones counted once. Returns
    the norm before clipping, as torch.nn.utils.clip_grad_norm_ does. All ranks call it."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return torch.tensor(_C.clip_grad_norm_([p for p in parameters], float(max_norm)))
