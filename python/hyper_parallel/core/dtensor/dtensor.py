"""DTensor of the C++ core: a local tensor with its mesh, placements and global shape. from_local,
redistribute and to_local are differentiable (the C++ core's autograd functions)."""

from typing import Optional, Sequence

import torch

from hyper_parallel import _C
from hyper_parallel.core.dtensor.placement_types import Placement

DTensor = _C.DTensor


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: _C.DeviceMesh,
    placements: Sequence[Placement],
    *,
    src_data_rank: Optional[int] = 0,
) -> DTensor:
    """Shards a full tensor; ``src_data_rank`` is the source's coordinate on every mesh dim
    (None: every rank shards its own copy, with no communication)."""
    return _C.distribute_tensor(tensor, device_mesh, list(placements), src_data_rank)
