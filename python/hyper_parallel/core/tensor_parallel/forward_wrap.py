"""Wrapping a module's forward: torch 1.13's forward pre-hooks see no keyword arguments and
cannot act after the forward pre-hooks, so a style that must do either wraps the forward."""

import types
from typing import Callable

from torch import nn


def wrap_forward(module: nn.Module, around: Callable) -> None:
    """``module``'s forward becomes ``around(module, forward, *args, **kwargs)``, with ``forward``
    the forward it had (bound to the module). Bound to the module itself and referring to no
    module, so a deep copy of the model calls its own forward, and no cycle keeps a model alive."""
    forward = module.forward
    unbound = forward.__func__ if getattr(forward, "__self__", None) is module else None
    other = forward if unbound is None else None
    del forward

    def wrapped(self, *args, **kwargs):
        inner = types.MethodType(unbound, self) if unbound is not None else other
        return around(self, inner, *args, **kwargs)

    module.forward = types.MethodType(wrapped, module)
