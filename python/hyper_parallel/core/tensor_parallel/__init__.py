"""Parallel styles and parallelize_module on torch.nn modules, plain and MC2."""

from hyper_parallel.core.tensor_parallel.grad_utils import ParameterLayout, clip_grad_norm_, full_tensor, layout_of
from hyper_parallel.core.tensor_parallel.loss import loss_parallel
from hyper_parallel.core.tensor_parallel.mc2 import MC2Linear
from hyper_parallel.core.tensor_parallel.mc2_style import MC2ColwiseParallel, MC2RowwiseParallel
from hyper_parallel.core.tensor_parallel.parallelize import parallelize_module
from hyper_parallel.core.tensor_parallel.style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "ColwiseParallel",
    "MC2ColwiseParallel",
    "MC2Linear",
    "MC2RowwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "ParameterLayout",
    "SequenceParallel",
    "clip_grad_norm_",
    "full_tensor",
    "layout_of",
    "loss_parallel",
    "parallelize_module",
]
