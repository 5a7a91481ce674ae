"""Trains the Python Llama 3 with tensor (+ sequence) and data parallelism on synthetic data, the
twin of llama3_train (same presets, data, optimizer, plan, checkpoint files and flag defaults:
train_defaults.json). Run dp x TP
processes (PYTHONPATH=build/python):
    hp-run --nproc-per-node 2 -- /usr/bin/python3 examples/torch/llama3/train.py --enable-mc2
    hp-run --nproc-per-node 4 -- /usr/bin/python3 examples/torch/llama3/train.py --dp 2 --batch-size 4
    ... train.py --steps 20 --checkpoint-dir /tmp/ckpt --checkpoint-every 5     (then --resume)"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import model as llama  # noqa: E402
from parallelize import parallelize_llama3  # noqa: E402

from hyper_parallel import (checkpoint, clip_grad_norm_, data_parallel, fully_shard, init_device_mesh,  # noqa: E402
                            loss_parallel)
from hyper_parallel.core import comm  # noqa: E402
from hyper_parallel.core.tensor_parallel.mc2 import MC2Contract  # noqa: E402


# The defaults of both trainers (llama3_train reads the same table).
DEFAULTS = json.loads((Path(__file__).resolve().parent / "train_defaults.json").read_text())


def _number(kind, least):
    """An argparse type: a ``kind`` number of at least ``least`` (the C++ trainer's checks)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value >= least:
            raise argparse.ArgumentTypeError(f"expected a number {'> 0' if least > 0 else '>= 0'}, got {text}")
        return value
    return parse


POSITIVE, NON_NEGATIVE, POSITIVE_FLOAT = _number(int, 1), _number(int, 0), _number(float, 1e-300)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split(". Run")[0].replace("\n", " ") + ".")
    d = DEFAULTS
    p.add_argument("--preset", default=d["preset"], choices=["debug", "tiny", "small", "bench"], help="model size")
    p.add_argument("--steps", type=POSITIVE, default=d["steps"], help="training steps")
    p.add_argument("--batch-size", type=POSITIVE, default=d["batch_size"],
                   help="sequences per step (the global batch, split over --dp)")
    p.add_argument("--dp", type=POSITIVE, default=d["dp"], help="data-parallel replicas (TP = world size / dp)")
    p.add_argument("--fsdp", type=POSITIVE, default=0,
                   help="shard parameters, gradients and AdamW state over N data-parallel ranks (fully_shard)")
    p.add_argument("--hsdp", type=POSITIVE, default=1, help="HSDP: R replicas of the --fsdp shards")
    p.add_argument("--no-reshard-after-forward", action="store_true",
                   help="keep each block's gathered parameters from its forward to its backward")
    p.add_argument("--dtype", default=d["dtype"], choices=["fp32", "bf16"])
    p.add_argument("--lr", type=POSITIVE_FLOAT, default=d["lr"], help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=d["seed"], help="weights and data")
    p.add_argument("--no-sequence-parallel", action="store_true", help="replicate activations between blocks")
    p.add_argument("--loss-parallel", action="store_true", help="keep logits sharded over the vocabulary")
    p.add_argument("--enable-mc2", action="store_true", help="fuse the collectives into the matmuls")
    p.add_argument("--mc2-scope", default=d["mc2_scope"], choices=["ffn", "all"], help="layers MC2 fuses")
    p.add_argument("--relaxed-mc2-contract", action="store_true", help="allow fp32 and any size under MC2")
    p.add_argument("--checkpoint-dir", help="checkpoint root: step-N/ directories and 'latest'")
    p.add_argument("--checkpoint-every", type=NON_NEGATIVE, default=d["checkpoint_every"],
                   help="save every N steps and at the last (0: never)")
    p.add_argument("--resume", action="store_true",
                   help="require a checkpoint in --checkpoint-dir (training continues from its latest one whenever "
                        "there is one)")
    p.add_argument("--async-checkpoint", action="store_true",
                   help="write checkpoints on a background thread while training goes on")
    args = p.parse_args(argv)
    if (args.checkpoint_every or args.resume or args.async_checkpoint) and not args.checkpoint_dir:
        p.error("--checkpoint-every, --resume and --async-checkpoint need --checkpoint-dir")
    if (args.mc2_scope != "ffn" or args.relaxed_mc2_contract) and not args.enable_mc2:
        p.error("--mc2-scope and --relaxed-mc2-contract need --enable-mc2")
    if args.fsdp:
        if args.dp != d["dp"]:
            p.error("--dp replicates and --fsdp shards the data-parallel dim: pass one of them")
        args.dp = args.fsdp * args.hsdp
    elif args.hsdp != 1 or args.no_reshard_after_forward:
        p.error("--hsdp and --no-reshard-after-forward need --fsdp")
    if args.batch_size % args.dp:
        p.error(f"--batch-size ({args.batch_size}) must be divisible by --dp ({args.dp})")
    return args


def make_meshes(args):
    """The TP mesh (the whole world, or mesh["tp"] of a {dp, tp} mesh) and the dp mesh or None
    (with --hsdp, the {replicate, shard} mesh of a {replicate, shard, tp} one)."""
    world = dist.get_world_size()
    if world % args.dp:
        raise ValueError(f"train.py: expected --dp to divide the world size ({world}), got {args.dp}")
    if args.dp == 1 and not args.fsdp:
        return init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), None
    if args.hsdp > 1:
        mesh = init_device_mesh("cpu", (args.hsdp, args.fsdp, world // args.dp),
                                mesh_dim_names=("replicate", "shard", "tp"))
        return mesh["tp"], mesh[("replicate", "shard")]
    mesh = init_device_mesh("cpu", (args.dp, world // args.dp), mesh_dim_names=("dp", "tp"))
    return mesh["tp"], mesh["dp"]


def replica_of(dp_mesh) -> int:
    """This rank's data-parallel replica, 0 .. dp - 1 (row-major over the dp mesh's dims)."""
    index = 0
    for size, coordinate in zip(dp_mesh.shape, dp_mesh.get_coordinate()):
        index = index * size + coordinate
    return index


def build(args, mesh, dp_mesh=None):
    """The model (full weights from the seed on every rank, then the plan) and its AdamW."""
    model_args = llama.ModelArgs.from_preset(args.preset)
    torch.manual_seed(args.seed)
    model = llama.Transformer(model_args).to(torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    parallelize_llama3(model, mesh, enable_sequence_parallel=not args.no_sequence_parallel,
                       enable_loss_parallel=args.loss_parallel, enable_mc2=args.enable_mc2, mc2_scope=args.mc2_scope,
                       mc2_contract=MC2Contract.relaxed() if args.relaxed_mc2_contract else None)
    if args.fsdp:  # bottom-up, as torchtitan: each block, then the root
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=not args.no_reshard_after_forward)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=not args.no_reshard_after_forward)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    return model, optimizer


def train_step(args, model, optimizer, step, dp_mesh=None):
    """One step: forward, loss (vocabulary-parallel with --loss-parallel), backward (gradients
    averaged over dp), clipping over the global parameters, AdamW. Returns the global batch's
    (loss, grad norm)."""
    a = model.args
    batch = llama.synthetic_batch(args.seed, step, args.batch_size, a.max_seq_len, a.vocab_size)
    if dp_mesh is not None:  # this replica's rows of the global batch
        rows = args.batch_size // args.dp
        batch = batch[replica_of(dp_mesh) * rows:][:rows]
    inputs, targets = batch[:, :a.max_seq_len], batch[:, 1:]
    optimizer.zero_grad()
    logits = model(inputs)
    if args.loss_parallel:
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
    else:
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    grad_norm = clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    loss = loss.detach().float().reshape(1)
    if dp_mesh is not None:  # the replicas' mean losses averaged, as llama3_train does
        for dim in range(dp_mesh.ndim):
            loss = comm.all_reduce(loss, comm.ReduceOp.AVG, dp_mesh.get_group(dim))
    return loss.item(), grad_norm.item()


def train(args):
    """Runs the steps this launch owns; returns [(step, loss)]."""
    rank = dist.get_rank()
    mesh, dp_mesh = make_meshes(args)
    model, optimizer = build(args, mesh, dp_mesh)
    if dp_mesh is not None and not args.fsdp:
        data_parallel(model, dp_mesh, broadcast_buffers=False)  # the rope tables never change
    log = rank == 0
    if log:
        dp_mode = "" if not args.fsdp else f" (HSDP {args.hsdp} x {args.fsdp})" if args.hsdp > 1 else " (fully_shard)"
        print(f"llama3 (Python) {args.preset}, DP {args.dp}{dp_mode}, TP {mesh.size(0)}, "
              f"SP {'off' if args.no_sequence_parallel else 'on'}, "
              f"MC2 {'on (' + args.mc2_scope + ')' if args.enable_mc2 else 'off'}, loss parallel "
              f"{'on' if args.loss_parallel else 'off'}, {args.dtype}, batch {args.batch_size}", flush=True)
    first = resume(args, model, optimizer, log)
    losses = []
    for step in range(first, args.steps + 1):
        comm.maybe_kill_at_step(step)
        t0 = time.perf_counter()
        loss, grad_norm = train_step(args, model, optimizer, step, dp_mesh)
        ms = (time.perf_counter() - t0) * 1e3
        losses.append((step, loss))
        if log:
            print(f"step {step:3d} | loss {loss:8.4f} | grad norm {grad_norm:7.3f} | ms/step {ms:8.1f}", flush=True)
        saved = bool(args.checkpoint_every) and (step % args.checkpoint_every == 0 or step == args.steps)
        if saved:
            save(args, step, model, optimizer, log)
        # A preemption notice (hp-run's SIGUSR1): every rank stops after the same step, with a
        # checkpoint of it.
        if step < args.steps and comm.agree_on_preemption():
            if not saved and args.checkpoint_dir:
                save(args, step, model, optimizer, log)
            finish_save(log)  # published before hp-run hears of it
            if log:
                print(f"hp-preempted: checkpoint at step {step}" if args.checkpoint_dir else
                      f"hp-preempted: no checkpoint (no --checkpoint-dir); stopped after step {step}", flush=True)
            break
    finish_save(log)
    return losses


def resume(args, model, optimizer, log) -> int:
    """The first step to run: after the latest checkpoint in --checkpoint-dir if there is one (a
    restarted job continues by itself); with --resume one must exist."""
    if not args.checkpoint_dir:
        return 1
    latest = checkpoint.latest_step(args.checkpoint_dir)
    if latest is None:
        if args.resume:
            raise RuntimeError(f"train.py: expected a checkpoint to resume from in {args.checkpoint_dir!r}, got none")
        return 1
    t0 = time.perf_counter()
    checkpoint.load(args.checkpoint_dir, model, optimizer)
    if log:
        print(f"resumed from step {latest} ({checkpoint.step_dir(args.checkpoint_dir, latest)}) in "
              f"{time.perf_counter() - t0:.2f} s", flush=True)
    return latest + 1


def finish_save(log) -> None:
    """Waits for the asynchronous save in flight, if any (raising its error), and logs it."""
    done = checkpoint.finish()
    if done and log:
        print(f"checkpoint {done['path']}: written in the background in {done['background_seconds']:.2f} s "
              f"(writer CPU {done['background_cpu_seconds']:.2f} s)", flush=True)


def save(args, step, model, optimizer, log) -> None:
    if args.async_checkpoint:
        finish_save(log)
    t0 = time.perf_counter()
    save_fn = checkpoint.async_save if args.async_checkpoint else checkpoint.save
    saved = save_fn(args.checkpoint_dir, step, model, optimizer)
    seconds = time.perf_counter() - t0
    if log and args.async_checkpoint:
        print(f"checkpoint {saved['path']}: {saved['total_bytes'] / 1e6:.1f} MB, training stalled {seconds:.3f} s "
              "(snapshot; writing in the background)", flush=True)
    elif log:
        print(f"checkpoint {saved['path']}: {saved['total_bytes'] / 1e6:.1f} MB in {seconds:.2f} s", flush=True)


def main() -> int:
    args = parse_args()
    t0 = time.perf_counter()
    dist.init_process_group("gloo")
    comm.ensure_initialized()
    if dist.get_rank() == 0:
        print(f"rendezvous of {dist.get_world_size()} ranks (attempt {comm.restart_count()}) in "
              f"{time.perf_counter() - t0:.2f} s", flush=True)
    losses = train(args)
    fell = len(losses) < 2 or losses[-1][1] < losses[0][1]
    if dist.get_rank() == 0 and losses:
        print(f"loss {'fell' if fell else 'did NOT fall'}: {losses[0][1]:.4f} -> {losses[-1][1]:.4f} "
              f"(last {losses[-1][1]!r})", flush=True)
    dist.destroy_process_group()
    # A preempted run stops early by design: success.
    return 0 if fell or comm.preemption_requested() else 1


if __name__ == "__main__":
    sys.exit(main())
