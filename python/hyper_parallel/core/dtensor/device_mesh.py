"""DeviceMesh: the world's ranks in an n-d grid, one torch.distributed ProcessGroup per line of
each mesh dimension, made collectively when the mesh is made."""

import datetime
from typing import Optional, Sequence

import torch.distributed as dist

from hyper_parallel import _C
from hyper_parallel.core.comm import ensure_initialized

DeviceMesh = _C.DeviceMesh


def _new_group(ranks):
    """One line's group: every rank makes every line's group, in the core's order (the
    new_group contract); a rank outside the line gets None."""
    timeout = datetime.timedelta(seconds=_C.world().timeout_s)
    group = dist.new_group(list(ranks), timeout=timeout)
    return None if group == dist.GroupMember.NON_GROUP_MEMBER else group


def init_device_mesh(
    device_type: str, mesh_shape: Sequence[int], *, mesh_dim_names: Optional[Sequence[str]] = None
) -> DeviceMesh:
    """A mesh over the whole world (the product of mesh_shape must be the world size), ranks in
    row-major order; slice it by name: ``mesh["tp"]``. ``mesh.get_group(dim)`` is a
    torch.distributed ProcessGroup, usable with torch.distributed's own calls. Collective: every
    rank calls it."""
    ensure_initialized()
    return _C.init_device_mesh(device_type, list(mesh_shape), list(mesh_dim_names or []), _new_group)
