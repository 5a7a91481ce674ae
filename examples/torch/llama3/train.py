"""Trains the Python Llama 3 with tensor (+ sequence) parallelism on synthetic data, printing the
loss. Run one process per TP rank:
    hp-run --nproc-per-node 2 -- /usr/bin/python3 examples/torch/llama3/train.py --enable-mc2
(with PYTHONPATH=build/python)."""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import model as llama  # noqa: E402
from parallelize import parallelize_llama3  # noqa: E402

from hyper_parallel import init_device_mesh  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--enable-mc2", action="store_true", help="fuse the feed-forward's collectives")
    parser.add_argument("--no-sequence-parallel", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model_args = llama.ModelArgs.small()
    torch.manual_seed(42)  # the same full weights on every rank, then sharded
    model = llama.Transformer(model_args).to(torch.bfloat16)
    parallelize_llama3(model, mesh, enable_mc2=args.enable_mc2,
                       enable_sequence_parallel=not args.no_sequence_parallel)
    if rank == 0:
        print(f"llama3 (Python) small, TP {mesh.size(0)}, MC2 {'on' if args.enable_mc2 else 'off'}, bf16", flush=True)
    log = (lambda step, loss: print(f"step {step:3d} | loss {loss:8.4f}", flush=True)) if rank == 0 else None
    losses = llama.train_steps(model, model_args, args.steps, log=log)
    if rank == 0:
        print(f"loss {'fell' if losses[-1] < losses[0] else 'did NOT fall'}: {losses[0]:.4f} -> {losses[-1]:.4f}")
    dist.destroy_process_group()
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    sys.exit(main())
