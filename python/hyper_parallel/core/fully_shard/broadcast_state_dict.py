"""set_model_state_dict's broadcast_from_rank0: rank 0's whole values loaded on every rank.

Rank 0 first checks its dict against the model and broadcasts one header: its verdict (a
problem is the same ValueError on every rank, before any tensor moves), which of the model's
keys it has, its keys the model lacks, its non-tensor values (a module's extra state) and the
dict's ``_metadata`` (the modules' versions). Then each tensor is broadcast in turn, in the
model's order, and each rank keeps its piece. Every rank calls it with the same model."""

import pickle
from collections import OrderedDict
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel import _C
from hyper_parallel.core.fully_shard.state_dict import local_value
from hyper_parallel.core.tensor_parallel.grad_utils import layout_of

__all__ = ["from_rank0"]

# The dtypes the core's broadcast takes; any other travels as its bytes.
_SENDABLE = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32)


def _broadcast(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``tensor`` (of this shape and dtype on every rank)."""
    if tensor.dtype in _SENDABLE:
        return _C.broadcast(tensor.contiguous(), 0, dist.group.WORLD)
    raw = tensor.contiguous().view(-1).view(torch.uint8)
    words = torch.cat([raw, raw.new_zeros((-raw.numel()) % 4)]).view(torch.int32)
    got = _C.broadcast(words, 0, dist.group.WORLD).view(torch.uint8)[:raw.numel()]
    return got.view(tensor.dtype).view(tensor.shape)


def _broadcast_bytes(payload: bytes) -> bytes:
    """Rank 0's ``payload`` on every rank (the others pass anything)."""
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if dist.get_rank() == 0 else None
    length = int(_broadcast(torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)).item())
    got = _broadcast(data if data is not None else torch.empty(length, dtype=torch.uint8))
    return bytes(got.tolist())


def _global_shape(target: torch.Tensor):
    layout = layout_of(target)
    return tuple(layout.global_shape) if layout is not None else tuple(target.shape)


def _problems(entries: Dict[str, Any], state_dict, strict: bool) -> List[str]:
    """What in rank 0's ``state_dict`` cannot load into the model's ``entries``."""
    if not isinstance(state_dict, dict):
        return [f"expected a dict on rank 0, got {type(state_dict).__name__}"]
    problems = []
    for key, value in state_dict.items():
        if key not in entries:
            if strict:
                problems.append(f"unexpected key {key}")
        elif not isinstance(entries[key], torch.Tensor):
            continue  # a module's extra state: any value
        elif isinstance(value, _C.DTensor):
            problems.append(f"expected {key} whole, got a DTensor (broadcast_from_rank0 broadcasts whole tensors)")
        elif not isinstance(value, torch.Tensor):
            problems.append(f"expected {key} a tensor, got {type(value).__name__}")
        elif value.is_meta or value.layout != torch.strided or value.device.type != "cpu":
            problems.append(f"expected {key} a dense tensor with data on cpu, got one on {value.device} "
                            f"({value.layout})")
        elif tuple(value.shape) != _global_shape(entries[key]):
            problems.append(f"expected {key} of the whole tensor's shape {list(_global_shape(entries[key]))}, got "
                            f"{list(value.shape)}")
    if strict:
        problems += [f"missing key {key}" for key in entries if key not in state_dict]
    return problems


def _header(entries: Dict[str, Any], state_dict, strict: bool) -> bytes:
    """Rank 0's header (see the module's doc), or its problems, pickled."""
    problems = _problems(entries, state_dict, strict)
    if problems:
        return pickle.dumps({"problems": problems})
    header = {
        "present": [k in state_dict for k in entries],
        "unexpected": [k for k in state_dict if k not in entries],
        "extra": {k: state_dict[k] for k in entries if k in state_dict and not isinstance(entries[k], torch.Tensor)},
        "metadata": getattr(state_dict, "_metadata", None),
    }
    try:
        return pickle.dumps(header)
    except Exception as error:  # pylint: disable=broad-except  (any object's pickling may raise)
        return pickle.dumps(
            {"problems": [f"expected picklable extra states and metadata, got {type(error).__name__}: {error}"]})


def from_rank0(model: nn.Module, state_dict, params: Dict[str, torch.Tensor],
               strict: bool) -> Tuple["OrderedDict[str, Any]", List[str]]:
    """This rank's values of rank 0's ``state_dict`` for ``model`` (``params``: each key of a
    parameter -> the parameter), and rank 0's keys the model lacks."""
    from hyper_parallel.core import comm  # pylint: disable=import-outside-toplevel

    comm.ensure_initialized()
    rank = dist.get_rank()
    entries = model.state_dict(keep_vars=True)
    header = pickle.loads(_broadcast_bytes(_header(entries, state_dict, strict) if rank == 0 else b""))
    if "problems" in header:
        raise ValueError(f"set_model_state_dict: rank 0's state_dict cannot load: {'; '.join(header['problems'])}")
    out = OrderedDict()
    for (key, entry), has in zip(entries.items(), header["present"]):
        if not has:
            continue
        if not isinstance(entry, torch.Tensor):
            out[key] = header["extra"][key]
            continue
        target = params.get(key, entry)
        if rank == 0:
            whole = state_dict[key].detach().to(target.dtype)
        else:
            whole = torch.empty(_global_shape(target), dtype=target.dtype)
        out[key] = local_value(key, _broadcast(whole), target)
    if header["metadata"] is not None:
        out._metadata = header["metadata"]
    return out, header["unexpected"]
