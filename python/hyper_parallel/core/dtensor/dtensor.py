"""DTensor of the C++ core: a local tensor with its mesh, placements and global shape. from_local,
redistribute and to_local are differentiable (the C++ core's autograd functions).

Placements are Shard / Replicate / Partial objects or, as in the original, layout names: one
entry per tensor dim, a mesh dim's name, "None", or a tuple of names (``("dp", "None")`` on a
("dp", "tp") mesh is ``[Shard(0), Replicate()]``). A mesh left out is the one of the innermost
``with mesh:``; placements left out replicate."""

from typing import Optional, Sequence

import torch

from hyper_parallel import _C

DTensor = _C.DTensor


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: Optional[_C.DeviceMesh] = None,
    placements: Optional[Sequence] = None,
    *,
    src_data_rank: Optional[int] = 0,
) -> DTensor:
    """Shards a full tensor; ``src_data_rank`` is the source's coordinate on every mesh dim
    (None: every rank shards its own copy, with no communication)."""
    return _C.distribute_tensor(tensor, device_mesh, placements, src_data_rank)


def _size_and_layout(name, size, device_mesh, placements):
    """torch's ``f(*size, device_mesh=, placements=)`` or the original's ``f(size, device_mesh,
    placements)``: the global size, the mesh and the placements."""
    if size and isinstance(size[-1], _C.DeviceMesh):  # f(size, device_mesh)
        size, device_mesh = size[:-1], size[-1]
    elif len(size) >= 2 and isinstance(size[-2], _C.DeviceMesh):  # f(size, device_mesh, placements)
        size, device_mesh, placements = size[:-2], size[-2], size[-1]
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(s, int) for s in size):
        raise TypeError(f"{name}: expected the global size as ints, got {size!r}")
    mesh = device_mesh if device_mesh is not None else _C.DeviceMesh.get_current_mesh()
    return list(size), mesh, placements


def _check_plain(name, layout, requires_grad):
    """torch's factory keywords this DTensor can honour: a strided layout, no leaf to train (a
    DTensor here has no .grad: make the local tensor require grad and wrap it with from_local)."""
    if layout not in (None, torch.strided):
        raise NotImplementedError(f"{name}: expected layout torch.strided, got {layout}")
    if requires_grad:
        raise NotImplementedError(f"{name}: expected requires_grad False, got True (a DTensor has no .grad here: "
                                  "make the local tensor require grad and pass it to DTensor.from_local)")


def _sharded(name, size, device_mesh, placements, layout, requires_grad, fill) -> DTensor:
    """A factory's DTensor: this rank's shard of the global size, made by ``fill(local_shape)``."""
    _check_plain(name, layout, requires_grad)
    shape, mesh, placements = _size_and_layout(name, size, device_mesh, placements)
    return DTensor.from_local(fill(_C.local_shape(shape, mesh, placements)), mesh, placements, shape=shape)


def _factory(name, fill):
    def make(*size, device_mesh=None, placements=None, dtype=None, layout=torch.strided, requires_grad=False):
        return _sharded(name, size, device_mesh, placements, layout, requires_grad,
                        lambda local_shape: fill(local_shape, dtype=dtype))

    make.__name__ = name
    make.__doc__ = (f"A DTensor of the global ``size`` laid out by ``placements`` on ``device_mesh``, "
                    f"each rank making only its own shard, as torch.distributed.tensor.{name}.")
    return make


ones = _factory("ones", torch.ones)
zeros = _factory("zeros", torch.zeros)
empty = _factory("empty", torch.empty)


def full(*size_and_value, device_mesh=None, placements=None, dtype=None, layout=torch.strided,
         requires_grad=False) -> DTensor:
    """``full(size, fill_value, device_mesh=, placements=)``: ``ones`` filled with ``fill_value``."""
    if len(size_and_value) < 2:
        raise TypeError(f"full: expected (size, fill_value), got {size_and_value!r}")
    size, fill_value, rest = size_and_value[0], size_and_value[1], size_and_value[2:]
    return _sharded("full", (size,) + rest, device_mesh, placements, layout, requires_grad,
                    lambda local_shape: torch.full(local_shape, fill_value, dtype=dtype))
