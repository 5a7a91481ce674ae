"""DeviceMesh, placements and DTensor of the C++ core (differentiable redistribution)."""

from hyper_parallel.core.dtensor.debug import CommDebugMode
from hyper_parallel.core.dtensor.device_mesh import DeviceMesh, get_current_mesh, init_device_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor, distribute_tensor, empty, full, ones, zeros
from hyper_parallel.core.dtensor.init_weights import init_empty_weights, init_on_device
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = [
    "CommDebugMode",
    "DTensor",
    "DeviceMesh",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "distribute_tensor",
    "empty",
    "full",
    "get_current_mesh",
    "init_device_mesh",
    "init_empty_weights",
    "init_on_device",
    "ones",
    "zeros",
]
