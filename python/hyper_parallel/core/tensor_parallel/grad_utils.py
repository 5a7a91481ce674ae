"""Whole-model helpers that know which parameters are sharded: the layouts the styles recorded.
Parameters stay plain local tensors (the optimizer sees its shard and stays fast), so, unlike
PyTorch's DTensor parameters, ``isinstance(p, DTensor)`` is False and there is no
``p.full_tensor()`` method: ``layout_of(p)`` and ``full_tensor(p)`` give the global view."""

import functools
import math
from typing import Iterable, NamedTuple, Optional, Tuple

import torch

from hyper_parallel import _C
from hyper_parallel.core.dtensor.placement_types import Placement, as_python

__all__ = ["ParameterLayout", "clip_grad_norm_", "full_tensor", "install_torch_clip", "layout_of"]

# torch's own, also if this module is loaded again after install_torch_clip.
_torch_clip_grad_norm_ = getattr(torch.nn.utils.clip_grad.clip_grad_norm_, "_torch_own",
                                 torch.nn.utils.clip_grad.clip_grad_norm_)


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
    the norm before clipping, as torch.nn.utils.clip_grad_norm_ does, in the gradients' dtype
    (promoted over them; float32 without any). All ranks call it."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = (p.grad if p.grad is not None else getattr(p, "main_grad", None) for p in params)
    dtypes = [g.dtype for g in grads if g is not None]
    dtype = functools.reduce(torch.promote_types, dtypes) if dtypes else torch.float32
    return torch.tensor(_C.clip_grad_norm_(params, float(max_norm)), dtype=dtype)


def _clip_grad_norm_by_layout_(parameters, max_norm: float, norm_type: float = 2.0,
                               error_if_nonfinite: bool = False) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ once hyper_parallel is imported. Over parameters that a style
    or fully_shard laid out (this rank's pieces, not DTensors, so torch's own would scale each rank
    by the norm of its pieces, a different factor on each) it is clip_grad_norm_ above: the global
    norm. Over any others it is torch's own."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if all(_C.layout_of(p) is None for p in params):
        return _torch_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    if float(norm_type) != 2.0:
        raise NotImplementedError(f"clip_grad_norm_: expected norm_type 2.0 (the global L2 norm) for parameters "
                                  f"that hyper_parallel laid out, got {norm_type}")
    if error_if_nonfinite:
        norm = _C.grad_norm(params)
        if not math.isfinite(norm):
            raise RuntimeError(f"clip_grad_norm_: expected a finite total norm of the gradients "
                               f"(error_if_nonfinite=True), got {norm}")
    return clip_grad_norm_(params, max_norm)


_clip_grad_norm_by_layout_._torch_own = _torch_clip_grad_norm_


def install_torch_clip() -> None:
    """Routes torch.nn.utils.clip_grad_norm_ (code written for DTensor parameters calls it) through
    _clip_grad_norm_by_layout_; a name imported from torch before hyper_parallel keeps torch's."""
    torch.nn.utils.clip_grad_norm_ = torch.nn.utils.clip_grad.clip_grad_norm_ = _clip_grad_norm_by_layout_
