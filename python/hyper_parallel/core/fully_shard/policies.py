"""The policies fully_shard takes, as PyTorch FSDP2 and HyperParallel name them."""

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: the gathered parameters' dtype (the shards keep theirs: the optimizer's
    copy); ``reduce_dtype``: the gradient reduction's; ``output_dtype``: the floating outputs of a
    module fully_shard was applied to are cast to it (None: left as computed);
    ``cast_forward_inputs``: floating inputs of a managed module are cast to param_dtype;
    ``apply_grad_on_fp32_main_grad``: each shard's reduced gradient is added to the parameter's
    ``main_grad`` in the reduce dtype (not cast to the shard's), and ``.grad`` is left as it is,
    for an optimizer that steps on ``main_grad`` (HyperParallel's option; ``zero_grad`` clears it)."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    apply_grad_on_fp32_main_grad: bool = False


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (the default)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Shards in host memory: where they are on a CPU build. ``pin_memory`` needs an accelerator,
    so fully_shard refuses ``pin_memory=True`` here (pass False)."""

    pin_memory: bool = True
