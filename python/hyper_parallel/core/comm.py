"""Process groups, collectives and counters of the C++ core.

The world is the one ``torch.distributed.init_process_group("gloo")`` made: the C++ core joins
it (no second rendezvous) the first time it is needed, and adopts torch's process groups: every
function here that takes a group takes a ``torch.distributed`` ProcessGroup.
"""

import torch.distributed as dist

from hyper_parallel import _C

Group = _C.Group
ReduceOp = _C.ReduceOp
CommRegion = _C.CommRegion
all_gather = _C.all_gather
reduce_scatter = _C.reduce_scatter
all_reduce = _C.all_reduce
all_to_all = _C.all_to_all
broadcast = _C.broadcast
barrier = _C.barrier
collective_count = _C.collective_count
total_collective_count = _C.total_collective_count
reset_collective_counts = _C.reset_collective_counts
collective_counts_summary = _C.collective_counts_summary
payload_bytes_sent = _C.payload_bytes_sent
# The life of a launch (hp-run's restarts and preemption notices; see lifecycle.h).
restart_count = _C.restart_count
preemption_requested = _C.preemption_requested
maybe_kill_at_step = _C.maybe_kill_at_step


def agree_on_preemption(group=None) -> bool:
    """Whether any rank of ``group`` (default: the world) was asked to stop (hp-run's SIGUSR1).
    Collective: every rank gets the same answer, so all stop after the same step."""
    ensure_initialized()
    return _C.agree_on_preemption(group if group is not None else dist.group.WORLD)


def ensure_initialized() -> None:
    """Joins torch.distributed's world (its default process group and store) once."""
    if _C.is_initialized():
        return
    if not dist.is_initialized():
        raise RuntimeError(
            "hyper_parallel: torch.distributed is not initialized; call "
            'torch.distributed.init_process_group("gloo") first'
        )
    _C.init_process_group_from(dist.group.WORLD, dist.distributed_c10d._get_default_store())


def world():
    """The world group as torch.distributed's default ProcessGroup."""
    ensure_initialized()
    return dist.group.WORLD
