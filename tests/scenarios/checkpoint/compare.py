"""Compares every tensor of two checkpoints (the whole value of each key, whatever the TP degrees
they were saved at): exits 0 if every key exists in both with bitwise-equal values, else prints
the keys that differ. One process, no process group.
    python3 compare.py ROOT_A ROOT_B"""

import json
import sys

import torch

from hyper_parallel import _C
from hyper_parallel import checkpoint


def full_tensors(root: str):
    step_dir = checkpoint.step_dir(root, checkpoint.latest_step(root))
    with open(f"{step_dir}/index.json") as f:
        index = json.load(f)["tensors"]
    dtypes = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "F16": torch.float16,
              "I64": torch.int64, "I32": torch.int32}
    state, tensors = _C.CheckpointState(), {}
    for key, info in index.items():
        tensors[key] = torch.empty(info["global_shape"], dtype=dtypes[info["dtype"]])
        state.add_tensor(key, tensors[key])
    _C.checkpoint_load(root, state, True)
    return tensors


def main(a: str, b: str) -> int:
    ta, tb = full_tensors(a), full_tensors(b)
    differ = sorted(set(ta) ^ set(tb)) + [k for k in ta if k in tb and not torch.equal(ta[k], tb[k])]
    if differ:
        print(f"compare.py: {len(differ)} of {len(ta)} keys differ: {differ[:10]}")
        return 1
    optim = sum(k.startswith("optim.") for k in ta)
    print(f"compare.py: {len(ta)} tensors bitwise equal ({optim} of them AdamW state)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
