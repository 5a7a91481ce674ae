"""A job for python_timeout.sh: rank 1 skips one collective on a torch.distributed group that
hyper_parallel adopted (argv[1]: "world", the default group, or "subgroup", one made by new_group),
in a world made with a timeout of argv[2] seconds. Rank 0 must fail within HP_TIMEOUT_S if set,
else within that timeout, naming the peer it waited for. Rank 1 waits in the store until rank 0
has answered, so no closed connection ends rank 0's wait first. Prints PASS or FAIL on rank 0."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import hyper_parallel._C as C

torch_timeout_s = float(sys.argv[2])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=torch_timeout_s))
group = dist.group.WORLD if sys.argv[1] == "world" else dist.new_group([0, 1])
store = dist.distributed_c10d._get_default_store()
limit_s = float(os.environ.get("HP_TIMEOUT_S") or torch_timeout_s)
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
        if elapsed > limit_s + 10:
            verdict = f"FAIL: expected a failure within {limit_s:g} s, got {elapsed:.1f} s"
        elif "rank 1" not in message:
            verdict = "FAIL: expected the message to name rank 1"
        else:
            verdict = "PASS"
    print(f"python_timeout {sys.argv[1]}: {verdict}", flush=True)
    store.set("rank0_answered", "1")
    store.wait(["rank1_left"])
else:
    store.wait(["rank0_answered"], datetime.timedelta(seconds=120))
    store.set("rank1_left", "1")
sys.stdout.flush()
os._exit(0)  # the group's connections are failed on rank 0; skip the teardown that would use them
