"""Sharded, resharding, atomic checkpoints of a torch.nn.Module and its torch.optim.AdamW (or Adam), in the
C++ library's files: the same index, keys (``<fqn>``, ``optim.<fqn>.{exp_avg,exp_avg_sq,step}``),
atomic publish and errors, written and read by the C++ core. A checkpoint of the C++ trainer loads
here and the reverse, at any TP degree.

Usage (every rank)::

    from hyper_parallel import checkpoint
    checkpoint.save("/ckpt", step, model, optimizer)
    step = checkpoint.latest_step("/ckpt")          # None without a checkpoint
    checkpoint.load("/ckpt", model, optimizer)       # follows `latest`; reshards to this TP degree

    checkpoint.async_save("/ckpt", step, model, optimizer)  # returns after a copy of this rank's share
    ...                                                     # training goes on while it is written
    checkpoint.finish()                                     # before the job ends: raises its error

AdamW's step is an int64 [1] on disk and torch's float tensor in memory; a parameter without
optimizer state yet gets zeros and step 0 (what AdamW would make on its first step), so a load
before the first step restores the optimizer too.
"""

from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel import _C
from hyper_parallel.core import comm

__all__ = ["save", "async_save", "finish", "load", "latest_step", "step_dir", "export_full"]


def _adamw_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> Dict[str, torch.Tensor]:
    """AdamW's (or Adam's: the same moments and step) state of ``param``, made if empty."""
    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        raise TypeError(f"hyper_parallel.checkpoint: expected a torch.optim.AdamW or torch.optim.Adam, got "
                        f"{type(optimizer).__name__}")
    state = optimizer.state[param]
    if not state:
        amsgrad = next(g["amsgrad"] for g in optimizer.param_groups if any(p is param for p in g["params"]))
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if amsgrad:
            state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


def _persistent_buffers(model: nn.Module):
    """The buffers ``model.state_dict()`` holds, by FQN, each tensor once (under its first
    persistent name): those registered with persistent=False (a rotary cache, say) are left out,
    as torch leaves them out."""
    seen, buffers = set(), []
    for prefix, module in model.named_modules():
        for name, buffer in module._buffers.items():  # pylint: disable=protected-access
            skipped = module._non_persistent_buffers_set  # pylint: disable=protected-access
            if buffer is None or name in skipped or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            buffers.append((f"{prefix}.{name}" if prefix else name, buffer))
    return buffers


def _state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> "_C.CheckpointState":
    """The C++ state aliasing the model's parameters, persistent buffers and AdamW's state."""
    state = _C.CheckpointState()
    params = list(model.named_parameters())
    for fqn, p in params:
        state.add_tensor(fqn, p)
    for fqn, b in _persistent_buffers(model):
        state.add_tensor(fqn, b)
    if optimizer is not None:
        in_model = {id(p) for _, p in params}
        outside = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in in_model]
        if outside:
            raise ValueError(f"hyper_parallel.checkpoint: expected the optimizer's parameters to be the model's, got "
                             f"{len(outside)} outside it (shapes {[tuple(p.shape) for p in outside][:4]}): their "
                             "optimizer state has no name to be saved or loaded under")
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for fqn, p in params:
            if id(p) not in owned:
                continue
            s = _adamw_state(optimizer, p)
            state.add_adamw(fqn, p, s["exp_avg"], s["exp_avg_sq"], s.get("max_exp_avg_sq"), s["step"])
    return state


def save(dir: str, step: int, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
         fsync: bool = True) -> dict:
    """Writes ``dir/step-<step>`` and points ``dir/latest`` at it (after waiting for an
    asynchronous save in flight, whose error it raises). Collective over the world.
    Returns ``{"path", "total_bytes", "bytes_written"}``."""
    comm.ensure_initialized()
    return _C.checkpoint_save(dir, _state(model, optimizer), step, fsync)


def async_save(dir: str, step: int, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
               fsync: bool = True) -> dict:
    """``save``, returning once this rank's share of the state is copied into staging buffers; a
    C++ thread (no GIL) writes, fsyncs and publishes the same files while training goes on, its
    collectives on a group of its own. It first waits for the previous asynchronous save and
    raises that save's error, if any; so does ``finish``. Extra memory: one copy of the tensors
    this rank writes, kept for the next save. Collective over the world."""
    comm.ensure_initialized()
    return _C.checkpoint_save(dir, _state(model, optimizer), step, fsync, asynchronous=True)


def finish() -> Optional[dict]:
    """Waits for the asynchronous save in flight and returns its result (with
    ``background_seconds`` and ``background_cpu_seconds``), or raises its error; None if no save
    was in flight. Call it on every rank before the job ends."""
    return _C.checkpoint_finish()


def load(dir: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
         strict: bool = True, strict_dtype: bool = False, collective: bool = True) -> None:
    """Loads ``dir`` (a step directory, or a root whose ``latest`` names one) into the model and
    optimizer, resharding to this run's layouts. A floating tensor saved in another floating
    dtype is cast to this run's (with one warning; ``strict_dtype=True`` refuses it instead), as
    PyTorch DCP does. Nothing changes unless everything checks out (keys, dtypes, shapes,
    crc32s) on every rank: collective over the world (as DCP's load), a failure on one rank is
    raised on all of them. ``collective=False``: this rank loads alone, without communication.
    Errors name the file and the key."""
    if collective and dist.is_initialized():
        comm.ensure_initialized()
    try:
        state = _state(model, optimizer)
    except Exception as error:  # pylint: disable=broad-except  # re-raised below, after the peers learn of it
        if collective:  # the other ranks raise it too, rather than wait for this one in load
            try:
                _C.checkpoint_abandon_load(f"{type(error).__name__}: {error}")
            except RuntimeError:
                pass
        raise
    _C.checkpoint_load(dir, state, strict, strict_dtype, collective)


def latest_step(dir: str) -> Optional[int]:
    """The step ``dir/latest`` names; None without one."""
    return _C.checkpoint_latest_step(dir)


def step_dir(dir: str, step: int) -> str:
    """``dir/step-<step>``."""
    return _C.checkpoint_step_dir(dir, step)


def export_full(dir: str, out_file: str) -> None:
    """Every non-optimizer tensor, unsharded, as one safetensors file named by FQN (one process)."""
    _C.checkpoint_export_full(dir, out_file)
