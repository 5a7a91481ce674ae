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

import weakref
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["init_empty_weights", "init_on_device"]


# torch's own: an inner context registers through them, not through the outer one's moves.
_REGISTER_PARAMETER, _REGISTER_BUFFER = nn.Module.register_parameter, nn.Module.register_buffer


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == device.type and (device.index is None or tensor.device.index == device.index)


@contextmanager
def init_on_device(device, include_buffers: bool = False):
    """Inside, every parameter a module registers (``include_buffers``: every buffer passed to
    ``register_buffer``; one assigned later by attribute to a registered name is not) is moved to
    ``device`` as it is registered. A parameter keeps its class, ``requires_grad`` and attributes,
    and one parameter registered on several modules stays one (a tie). Lazy modules' uninitialized
    parameters are left to materialize where their first input is. Nested, the innermost wins."""
    device = torch.device(device)
    outer = nn.Module.register_parameter, nn.Module.register_buffer
    # id(parameter as made) -> (a weak reference to it, its moved replacement): a tie stays one
    # parameter, and the one made is freed as soon as its module is done with it.
    moved = {}

    def on_device_parameter(module, name, param):
        if param is None or isinstance(param, nn.parameter.UninitializedParameter) or _on(param, device):
            return _REGISTER_PARAMETER(module, name, param)
        made, replacement = moved.get(id(param), (None, None))
        if made is None or made() is not param:  # not moved yet (or an earlier one's reused id)
            replacement = torch.Tensor._make_subclass(type(param), param.detach().to(device), param.requires_grad)
            replacement.__dict__.update(param.__dict__)  # attributes set on the parameter
            moved[id(param)] = (weakref.ref(param), replacement)
        return _REGISTER_PARAMETER(module, name, replacement)

    def on_device_buffer(module, name, tensor, persistent=True):
        _REGISTER_BUFFER(module, name, tensor if tensor is None else tensor.to(device), persistent=persistent)

    nn.Module.register_parameter = on_device_parameter
    if include_buffers:
        nn.Module.register_buffer = on_device_buffer
    try:
        yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = outer


@contextmanager
def init_empty_weights(include_buffers: bool = False):
    """``init_on_device("meta")``: parameters (``include_buffers``: buffers too) without storage."""
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield
