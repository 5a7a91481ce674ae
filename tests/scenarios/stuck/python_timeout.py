"""A job for python_timeout.sh: rank 1 skips one collective on a torch.distributed group that
hyper_parallel adopted, and rank 0 must fail with a timeout that names rank 1, after the bound
and within it.
    python_timeout.py GROUP WORLD_TIMEOUT SUBGROUP_TIMEOUT STORE
GROUP: "world" (torch's default group) or "subgroup" (one made by new_group, with a timeout of
SUBGROUP_TIMEOUT seconds, or torch's default if "-"); WORLD_TIMEOUT: seconds given to
init_process_group; STORE: "store" to hand init_process_group a TCPStore of its own, whose
timeout (30 min) is not the world's. The bound is HP_TIMEOUT_S if set, else the group's own
timeout. Rank 1 waits in the store until rank 0 has answered, so no closed connection ends rank
0's wait first. Prints PASS or FAIL on rank 0."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import hyper_parallel._C as C

which, world_timeout, subgroup_timeout, store_mode = sys.argv[1:5]
seconds = datetime.timedelta(seconds=1).__mul__
kwargs = {"timeout": seconds(float(world_timeout))}
if store_mode == "store":
    kwargs["store"] = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                    int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]) == 0,
                                    seconds(1800))
    kwargs.update(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
dist.init_process_group("gloo", **kwargs)
if which == "world":
    group, own_timeout = dist.group.WORLD, float(world_timeout)
elif subgroup_timeout == "-":
    group, own_timeout = dist.new_group([0, 1]), 1800.0
else:
    group, own_timeout = dist.new_group([0, 1], timeout=seconds(float(subgroup_timeout))), float(subgroup_timeout)
store = dist.distributed_c10d._get_default_store()
limit_s = float(os.environ.get("HP_TIMEOUT_S") or own_timeout)
C.all_reduce(torch.ones(4), C.ReduceOp.SUM, group)  # the group works: both ranks are in it

if dist.get_rank() == 0:
    start = time.monotonic()
    try:
        C.all_gather(torch.ones(4), 0, group)
        verdict = "FAIL: expected the all_gather to fail, got a result"
    except RuntimeError as error:
        elapsed = time.monotonic() - start
        message = str(error).splitlines()[0]
        print(f"rank 0 failed after {elapsed:.1f} s: {message}", flush=True)
        if not limit_s - 1 <= elapsed <= limit_s + 10:
            verdict = f"FAIL: expected a failure after {limit_s:g} s, got {elapsed:.1f} s"
        elif "receive from rank 1" not in message or "Timed out" not in message:
            verdict = "FAIL: expected a timeout naming rank 1"
        else:
            verdict = "PASS"
    print(f"python_timeout {which}: {verdict}", flush=True)
    store.set("rank0_answered", "1")
    store.wait(["rank1_left"])
else:
    store.wait(["rank0_answered"], seconds(120))
    store.set("rank1_left", "1")
sys.stdout.flush()
os._exit(0)  # the group's connections are failed on rank 0; skip the teardown that would use them
