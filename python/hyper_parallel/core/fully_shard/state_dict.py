"""FSDPModule.load_state_dict: the original's (HyperParallel's HSDPModule.load_state_dict) value
rules over torch's loading.

``state_dict()`` gives each sharded parameter as this rank's piece. A value to load may be that
piece, the whole tensor (a checkpoint saved without parallelism), or a DTensor of the whole
tensor's shape (its local tensor where it is laid out as the parameter, else its whole tensor,
gathered over its mesh, Partial ones summed). For a whole tensor, each rank takes its own piece,
laid out as the parameter (fully_shard's pieces, nested in a tensor-parallel style's), with no
communication, so every rank passes the same whole tensors, as loading one file on every rank
does. torch then copies the pieces into the shards (a later gather sees they changed)."""

import warnings
from typing import Any

import torch
from torch import nn

from hyper_parallel import _C
from hyper_parallel.core.tensor_parallel.grad_utils import layout_of


def _shape(shape) -> str:
    return str(list(shape))


def _whole_or_piece(key: str, value: _C.DTensor, layout, target: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor where it is laid out as the parameter, else its whole tensor
    (gathered over its mesh: collective, every rank loads the same keys in the same order)."""
    want = tuple(layout.global_shape) if layout is not None else tuple(target.shape)
    if tuple(value.shape) != want:
        raise ValueError(f"FSDPModule.load_state_dict: expected {key} as a DTensor of the whole tensor's shape "
                         f"{_shape(want)}, got one of {_shape(value.shape)}")
    if layout is not None and value.device_mesh == layout.mesh and value.placements == tuple(layout.placements):
        return value.to_local()
    return value.full_tensor()


def local_value(key: str, value: Any, target: torch.Tensor) -> Any:
    """The value torch copies into ``target`` (a parameter or buffer of the module) for ``key``."""
    layout = layout_of(target)
    if isinstance(value, _C.DTensor):
        value = _whole_or_piece(key, value, layout, target)
    if layout is None or not isinstance(value, torch.Tensor) or tuple(value.shape) == tuple(target.shape):
        return value  # torch's own checks apply
    if tuple(value.shape) == tuple(layout.global_shape):
        return _C.distribute_tensor(value.detach(), layout.mesh, list(layout.placements), None).to_local()
    raise ValueError(f"FSDPModule.load_state_dict: expected {key} of this rank's piece's shape "
                     f"{_shape(target.shape)} or the whole tensor's {_shape(layout.global_shape)}, got "
                     f"{_shape(value.shape)}")


def make_values_local(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    """A load pre-hook of a module fully_shard was applied to (torch's load_state_dict runs it on
    that module, also from a module above it, before the module and those below it load): each
    value of a parameter or buffer there is made what torch copies into this rank's tensor. Tied
    parameters are found under each of their names. Inside the module's forward or backward (its
    gathered parameters stand in for the shards) it is a ValueError: the load would write the
    gathered buffers, and the shards would keep their values."""
    standing = getattr(module, "_fsdp_standing", None)
    if standing is not None and not standing.shards_in_place:
        raise ValueError(f"FSDPModule.load_state_dict: expected a load into {type(module).__name__} outside its "
                         "forward and backward, got one while its gathered parameters stand in for the shards")
    for name, sub in module.named_modules(remove_duplicate=False):
        sub_prefix = prefix + (name + "." if name else "")
        for tensors in (sub._parameters, sub._buffers):
            for tname, target in tensors.items():
                key = sub_prefix + tname
                if target is None or key not in state_dict:
                    continue
                if target.is_meta:
                    raise ValueError(f"FSDPModule.load_state_dict: expected {key} on a device, got it on meta (a "
                                     "copy into it would load nothing); call module.to_empty(device='cpu') first")
                state_dict[key] = local_value(key, state_dict[key], target)


def shards_in_state_dict(module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
    """A state-dict hook of a module fully_shard was applied to: while the gathered parameters
    stand in for the shards (a state_dict() inside its forward or backward), each parameter of
    its group is still given as this rank's piece, not as an alias of the gathered buffers, which
    the group frees after its forward."""
    standing = getattr(module, "_fsdp_standing", None)
    if standing is None or standing.shards_in_place:
        return
    shards = module._fsdp_group.parameters
    for path, sub in module.named_modules(remove_duplicate=False):
        for name in sub._parameters:
            key = prefix + (path + "." if path else "") + name
            index = standing.index_of(sub, name)
            if index is not None and key in state_dict:
                state_dict[key] = shards[index].detach()


def warn_if_assign(assign: bool) -> None:
    if assign:
        warnings.warn("FSDPModule.load_state_dict: assign=True is ignored (torch 1.13 has no assign): the "
                      "values are copied into the shards", stacklevel=3)
