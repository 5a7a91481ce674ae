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
from torch import nn

from hyper_parallel import _C

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


def _state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> "_C.CheckpointState":
    """The C++ state aliasing the model's parameters and buffers and AdamW's state."""
    state = _C.CheckpointState()
    params = list(model.named_parameters())
    for fqn, p in params:
        state.add_tensor(fqn, p)
    for fqn, b in model.named_buffers():
        state.add_tensor(fqn, b)
    if optimizer is not None:
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
    return _C.checkpoint_save(dir, _state(model, optimizer), step, fsync)


def async_save(dir: str, step: int, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
               fsync: bool = True) -> dict:
    """``save``, returning once this rank's share of the state is copied into staging buffers; a
    C++ thread (no GIL) writes, fsyncs and publishes the same files while training goes on, its
    collectives on a group of its own. It first waits for the previous asynchronous save and
    raises that save's error, if any; so does ``finish``. Extra memory: one copy of the tensors
    this rank writes, kept for the next save. Collective over the world."""
    return _C.checkpoint_save(dir, _state(model, optimizer), step, fsync, asynchronous=True)


def finish() -> Optional[dict]:
    """Waits for the asynchronous save in flight and returns its result (with
    ``background_seconds`` and ``background_cpu_seconds``), or raises its error; None if no save
    was in flight. Call it on every rank before the job ends."""
    return _C.checkpoint_finish()


def load(dir: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
         strict: bool = True, strict_dtype: bool = False) -> None:
    """Loads ``dir`` (a step directory, or a root whose ``latest`` names one) into the model and
    optimizer, resharding to this run's layouts. A floating tensor saved in another floating
    dtype is cast to this run's (with one warning; ``strict_dtype=True`` refuses it instead), as
    PyTorch DCP does. Nothing changes unless everything checks out (keys, dtypes, shapes,
    crc32s); errors name the file and the key."""
    _C.checkpoint_load(dir, _state(model, optimizer), strict, strict_dtype)


def latest_step(dir: str) -> Optional[int]:
    """The step ``dir/latest`` names; None without one."""
    return _C.checkpoint_latest_step(dir)


def step_dir(dir: str, step: int) -> str:
    """``dir/step-<step>``."""
    return _C.checkpoint_step_dir(dir, step)


def export_full(dir: str, out_file: str) -> None:
    """Every non-optimizer tensor, unsharded, as one safetensors file named by FQN (one process)."""
    _C.checkpoint_export_full(dir, out_file)
