"""Parallel styles and parallelize_module on torch.nn modules, plain and MC2.

The MC2 names (MC2Linear, MC2ColwiseParallel, MC2RowwiseParallel) are exported lazily, as in the
original: importing this package does not import the mc2 modules; the first use of a name does
(``_LAZY_EXPORTS`` maps each name to its module)."""

import importlib

from hyper_parallel.core.tensor_parallel.grad_utils import ParameterLayout, clip_grad_norm_, full_tensor, layout_of
from hyper_parallel.core.tensor_parallel.loss import is_loss_parallel_active, loss_parallel
from hyper_parallel.core.tensor_parallel.parallelize import parallelize_module
from hyper_parallel.core.tensor_parallel.style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

_LAZY_EXPORTS = {
    "MC2Linear": "hyper_parallel.core.tensor_parallel.mc2",
    "MC2ColwiseParallel": "hyper_parallel.core.tensor_parallel.mc2_style",
    "MC2RowwiseParallel": "hyper_parallel.core.tensor_parallel.mc2_style",
}


def __getattr__(name):
    if name in _LAZY_EXPORTS:
        value = getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
        globals()[name] = value  # later lookups find it without this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY_EXPORTS))


__all__ = [
    "ColwiseParallel",
    "MC2ColwiseParallel",
    "MC2Linear",
    "MC2RowwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "ParameterLayout",
    "SequenceParallel",
    "clip_grad_norm_",
    "full_tensor",
    "is_loss_parallel_active",
    "layout_of",
    "loss_parallel",
    "parallelize_module",
]
