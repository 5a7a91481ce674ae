"""The Python half of the cross-language checkpoint test: loads a Llama 3 checkpoint (model and
AdamW state, saved at any TP degree, by either language) into the Python model at this launch's
TP degree, then saves it unchanged to another root at the same step.
    hp-run --nproc-per-node N -- python3 reshard.py PRESET DTYPE FROM_ROOT TO_ROOT"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples", "torch",
                                "llama3"))

import model as llama  # noqa: E402
from parallelize import parallelize_llama3  # noqa: E402

from hyper_parallel import checkpoint, init_device_mesh  # noqa: E402


def main(preset: str, dtype: str, src: str, dst: str) -> int:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = llama.Transformer(llama.ModelArgs.from_preset(preset)).to(torch_dtype)
    parallelize_llama3(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    step = checkpoint.latest_step(src)
    checkpoint.load(src, model, optimizer)
    checkpoint.save(dst, step, model, optimizer)
    if dist.get_rank() == 0:
        print(f"resharded step {step} to TP {dist.get_world_size()}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
