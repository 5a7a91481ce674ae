"""hyper_parallel: tensor parallelism with MC2 (matmul fused with its collective), and data
parallelism over a mesh dimension, for PyTorch.

The work is done by the C++ core (the extension ``hyper_parallel._C``); this package gives it
PyTorch's shapes: ``init_device_mesh``, ``parallelize_module`` and the parallel styles, acting on
``torch.nn`` modules through forward hooks.

Usage (under ``hp-run --nproc-per-node 2 -- /usr/bin/python3 train.py``)::

    import torch.distributed as dist
    from hyper_parallel import init_device_mesh, parallelize_module, MC2ColwiseParallel, MC2RowwiseParallel
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    parallelize_module(mlp, mesh, {"fc1": MC2ColwiseParallel(), "fc2": MC2RowwiseParallel()})
"""

from hyper_parallel.core import tensor_parallel as _tensor_parallel
from hyper_parallel.core.data_parallel import data_parallel, no_sync
from hyper_parallel.core.dtensor import (DeviceMesh, DTensor, get_current_mesh, init_device_mesh, init_empty_weights,
                                         init_on_device)
from hyper_parallel.core.fully_shard import (
    CPUOffloadPolicy,
    FSDPModule,
    HSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from hyper_parallel.core.tensor_parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    clip_grad_norm_,
    full_tensor,
    layout_of,
    loss_parallel,
    parallelize_module,
)
from hyper_parallel import checkpoint  # noqa: E402  (hyper_parallel.checkpoint.save / load)
from hyper_parallel.core.tensor_parallel.grad_utils import install_torch_clip

install_torch_clip()  # torch.nn.utils.clip_grad_norm_ takes the global norm of laid-out parameters

# The MC2 names load their modules on first use, as in the original (the tensor_parallel
# package resolves them).
_LAZY_EXPORTS = _tensor_parallel._LAZY_EXPORTS


def __getattr__(name):
    if name in _LAZY_EXPORTS:
        return getattr(_tensor_parallel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY_EXPORTS))


__all__ = [
    "CPUOffloadPolicy",
    "ColwiseParallel",
    "DTensor",
    "DeviceMesh",
    "FSDPModule",
    "HSDPModule",
    "MC2ColwiseParallel",
    "MC2Linear",
    "MC2RowwiseParallel",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "checkpoint",
    "clip_grad_norm_",
    "data_parallel",
    "full_tensor",
    "fully_shard",
    "get_current_mesh",
    "init_device_mesh",
    "init_empty_weights",
    "init_on_device",
    "layout_of",
    "loss_parallel",
    "no_sync",
    "parallelize_module",
]
