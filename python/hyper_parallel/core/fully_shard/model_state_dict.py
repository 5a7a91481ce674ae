"""get_model_state_dict / set_model_state_dict: the original's (HyperParallel's
``hyper_parallel.core.fully_shard.api.get_model_state_dict``) and PyTorch's
(``torch.distributed.checkpoint.state_dict``) functions, for modules whose parameters fully_shard
or a tensor-parallel style laid out.

Usage (every rank)::

    from hyper_parallel.core.fully_shard import StateDictOptions, get_model_state_dict, set_model_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save(full, "model.pt")            # whole tensors, as a model without parallelism has them
    ...
    loaded = torch.load("model.pt") if dist.get_rank() == 0 else {}
    set_model_state_dict(model, loaded, options=StateDictOptions(full_state_dict=True,
                                                                  broadcast_from_rank0=True))

A sharded state dict (``full_state_dict=False``) has each laid-out parameter as this rank's piece
(a plain tensor, as ``model.state_dict()`` gives it; the original's and torch's are DTensors).
"""

import dataclasses
from collections import OrderedDict
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel import _C
from hyper_parallel.core.fully_shard.broadcast_state_dict import from_rank0
from hyper_parallel.core.fully_shard.state_dict import local_value
from hyper_parallel.core.tensor_parallel.grad_utils import layout_of

__all__ = ["StateDictOptions", "get_model_state_dict", "set_model_state_dict"]


@dataclasses.dataclass
class StateDictOptions:
    """torch.distributed.checkpoint.state_dict.StateDictOptions's fields (torch 1.13 has no such
    class; an instance of torch's own is accepted too).

    - full_state_dict: whole tensors (gathered: collective) in place of this rank's pieces.
    - cpu_offload: the values on the CPU; with full_state_dict, only rank 0 keeps them (the other
      ranks get an empty dict).
    - ignore_frozen_params: get_model_state_dict leaves out the parameters without requires_grad.
    - strict: set_model_state_dict's load_state_dict strictness.
    - broadcast_from_rank0: set_model_state_dict loads rank 0's whole tensors on every rank (the
      other ranks may pass an empty dict); needs full_state_dict.
    """

    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    keep_submodule_prefixes: bool = True
    strict: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False


_FLAGS = ("full_state_dict", "cpu_offload", "ignore_frozen_params", "strict", "broadcast_from_rank0")


def _checked(options, what: str) -> StateDictOptions:
    if options is None:
        return StateDictOptions()
    missing = [f for f in _FLAGS if not hasattr(options, f)]
    if missing:
        raise ValueError(f"{what}: expected a StateDictOptions, got {type(options).__name__} without {missing}")
    for flag in _FLAGS:
        if not isinstance(getattr(options, flag), bool):
            raise ValueError(f"{what}: expected options.{flag} a bool, got {getattr(options, flag)!r}")
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError(f"{what}: expected full_state_dict=True with broadcast_from_rank0=True, got "
                         "full_state_dict=False (rank 0 broadcasts whole tensors)")
    return StateDictOptions(**{f: getattr(options, f) for f in _FLAGS})


def _check_shards_in_place(model: nn.Module, what: str) -> None:
    """Outside the forward and backward of the model's fully_shard modules: inside, their
    modules hold the gathered parameters, without the shards' layouts."""
    for name, sub in model.named_modules():
        standing = getattr(sub, "_fsdp_standing", None)
        if standing is not None and not standing.shards_in_place:
            raise ValueError(f"{what}: expected a call outside the forward and backward of the model's fully_shard "
                             f"modules, got one while {name or 'the model'}'s gathered parameters stand in for its "
                             "shards")


def _parameters_by_key(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Each state-dict key of a parameter (every name of a tied one) -> the parameter."""
    out = {}
    for path, sub in model.named_modules(remove_duplicate=False):
        for name, param in sub._parameters.items():
            if param is not None:
                out[f"{path}.{name}" if path else name] = param
    return out


def get_model_state_dict(model: nn.Module, *, options: Optional[Any] = None) -> Dict[str, Any]:
    """``model.state_dict()``, with each laid-out parameter whole if ``options.full_state_dict``
    (gathered over its mesh: every rank calls it, with the same options). See StateDictOptions."""
    opts = _checked(options, "get_model_state_dict")
    _check_shards_in_place(model, "get_model_state_dict")
    state = model.state_dict()
    params = _parameters_by_key(model)
    if opts.ignore_frozen_params:
        state = {k: v for k, v in state.items() if k not in params or params[k].requires_grad}
    rank0_only = opts.full_state_dict and opts.cpu_offload and dist.is_initialized() and dist.get_rank() != 0
    whole: Dict[int, torch.Tensor] = {}  # a tied parameter is gathered once
    out = {}
    for key, value in state.items():
        param = params.get(key)
        if opts.full_state_dict and param is not None and layout_of(param) is not None:
            if id(param) not in whole:
                with torch.no_grad():  # the layout is the parameter's own: not of a detached alias
                    whole[id(param)] = _C.full_tensor(param)
            value = whole[id(param)]
        if opts.cpu_offload and isinstance(value, torch.Tensor):
            value = value.cpu()
        out[key] = value
    return {} if rank0_only else out


def set_model_state_dict(model: nn.Module, state_dict: Dict[str, Any], *, options: Optional[Any] = None):
    """Loads ``state_dict`` into ``model`` and returns load_state_dict's missing and unexpected
    keys. A laid-out parameter's value may be this rank's piece, the whole tensor (each rank
    takes its piece, without communication) or a DTensor. With ``broadcast_from_rank0``, rank 0's
    whole tensors are broadcast one at a time (each rank keeps its piece) and the other ranks'
    ``state_dict`` is not read. Collective with broadcast_from_rank0. See StateDictOptions."""
    opts = _checked(options, "set_model_state_dict")
    _check_shards_in_place(model, "set_model_state_dict")
    params = _parameters_by_key(model)
    unexpected = []
    if opts.broadcast_from_rank0:
        state_dict, unexpected = from_rank0(model, state_dict, params, opts.strict)
    else:
        local = OrderedDict((k, local_value(k, v, params[k]) if k in params else v) for k, v in state_dict.items())
        if hasattr(state_dict, "_metadata"):  # the modules' versions (BatchNorm's reads its own)
            local._metadata = state_dict._metadata
        state_dict = local
    result = model.load_state_dict(state_dict, strict=opts.strict)
    result.unexpected_keys.extend(unexpected)
    return result
