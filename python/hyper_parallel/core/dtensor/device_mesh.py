"""DeviceMesh: the world's ranks in an n-d grid, one torch.distributed ProcessGroup per line of
each mesh dimension, made collectively when the mesh is made."""

import datetime
from typing import Optional, Sequence

import torch
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


def _mesh_arguments(mesh):
    """``DeviceMesh(device_type, mesh)``'s mesh as (shape, ranks row-major, the group factory): a
    nested list, tuple, array or integer tensor of global ranks; None is the whole world in order."""
    ensure_initialized()
    if mesh is None:
        return [dist.get_world_size()], list(range(dist.get_world_size())), _new_group
    grid = torch.as_tensor(mesh)
    if grid.dtype.is_floating_point or grid.dtype.is_complex or grid.dtype == torch.bool or grid.dim() == 0:
        raise TypeError(f"DeviceMesh: expected an n-d grid of integer ranks, got {mesh!r}")
    return list(grid.shape), grid.flatten().tolist(), _new_group


def get_current_mesh() -> DeviceMesh:
    """The mesh of this thread's innermost ``with mesh:``; a ValueError if there is none."""
    return DeviceMesh.get_current_mesh()
