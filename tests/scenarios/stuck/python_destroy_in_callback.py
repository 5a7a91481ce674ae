"""hyper_parallel's destroy_process_group called from a callback of torch's work on a group the
package adopted, after torch destroyed that group: the callback runs on that group's own Gloo
thread, which destroying the group joins. Both ranks must finish (once: SIGABRT, "Resource
deadlock avoided")."""
import os
import time

import torch
import torch.distributed as dist

from hyper_parallel import _C
from hyper_parallel.core.comm import ensure_initialized

dist.init_process_group("gloo")
ensure_initialized()
world, rank = dist.get_world_size(), dist.get_rank()
group = dist.new_group(list(range(world)))
_C.all_reduce(torch.ones(1), _C.ReduceOp.SUM, group)  # adopted: the core holds the backend too
if rank == 1:
    time.sleep(1)  # the callback runs on Gloo's thread, not inline
work = dist.all_reduce(torch.ones(1), group=group, async_op=True)
dist.destroy_process_group(group)
del group  # the core's is now the last reference


def destroy(_):
    _C.destroy_process_group()
    return 1


future = work.get_future().then(destroy)
del work
future.wait()
assert not _C.is_initialized()
print(f"python_destroy_in_callback rank {rank}: PASS", flush=True)
# Skips the interpreter's teardown: torch 1.13 may abort there while a group it made is being
# destroyed ("terminate called without an active exception"), with or without this library.
os._exit(0)
