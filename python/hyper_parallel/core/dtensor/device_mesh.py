"""DeviceMesh: the world's ranks in an n-d grid, one process group per mesh dimension."""

from typing import Optional, Sequence

from hyper_parallel import _C
from hyper_parallel.core.comm import ensure_initialized

DeviceMesh = _C.DeviceMesh


def init_device_mesh(
    device_type: str, mesh_shape: Sequence[int], *, mesh_dim_names: Optional[Sequence[str]] = None
) -> DeviceMesh:
    """A mesh over the whole world (the product of mesh_shape must be the world size), ranks in
    row-major order; slice it by name: ``mesh["tp"]``. Collective: every rank calls it."""
    ensure_initialized()
    return _C.init_device_mesh(device_type, list(mesh_shape), list(mesh_dim_names or []))
