"""Building a module's parameters (and buffers) on another device, as HyperParallel's
``init_empty_weights`` / ``init_on_device`` (and Hugging Face accelerate's) do: on ``meta``, a
model too large for this process's memory is built without storage, then sharded
(``fully_shard`` takes meta parameters), materialized with ``module.to_empty(device="cpu")`` and
initialized, or loaded from a checkpoint.

Usage::

    with init_empty_weights():
        model = Transformer(config)        # parameters on meta: no storage
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")           # this rank's pieces only
    init_weights(model)

torch 1.13 has no default-device context, so each parameter is made where its module's
constructor makes it, then moved as it is registered: the peak is one parameter, not the model.
"""

from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["init_empty_weights", "init_on_device"]


@contextmanager
def init_on_device(device, include_buffers: bool = False):
    """Inside, every parameter a module registers (``include_buffers``: every buffer too) is
    moved to ``device`` as it is registered; it keeps its class and ``requires_grad``."""
    device = torch.device(device)
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def on_device_parameter(module, name, param):
        register_parameter(module, name, param)
        if param is not None and param.device != device:
            kept = module._parameters[name]  # pylint: disable=protected-access
            moved = type(kept)(kept.to(device), requires_grad=kept.requires_grad)
            moved.__dict__.update(kept.__dict__)  # attributes set on the parameter
            module._parameters[name] = moved  # pylint: disable=protected-access

    def on_device_buffer(module, name, tensor, persistent=True):
        register_buffer(module, name, tensor if tensor is None else tensor.to(device), persistent=persistent)

    nn.Module.register_parameter = on_device_parameter
    if include_buffers:
        nn.Module.register_buffer = on_device_buffer
    try:
        yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = register_parameter, register_buffer


@contextmanager
def init_empty_weights(include_buffers: bool = False):
    """``init_on_device("meta")``: parameters (``include_buffers``: buffers too) without storage."""
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield
