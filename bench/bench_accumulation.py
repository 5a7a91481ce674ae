#!/usr/bin/python3
"""Gradient accumulation under HSDP, three ways side by side in one launch (4 ranks, a 2 x 2
(replicate, shard) mesh): each micro-batch synced (a reduce-scatter and an all-reduce each),
set_requires_gradient_sync(False) until the last (the whole gradients held, one reduction), and
set_requires_all_reduce(False) until the last (a reduce-scatter each, the shard's sums held, one
all-reduce). Prints per step the collectives, the bytes this rank sent, what is held between
micro-batches and the best step time against the synced one; the gradients must match.

  PYTHONPATH=build/python bash bench/run_bench.sh $PWD/bench/bench_accumulation.py 500mbit 4 -- --steps 3
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel import full_tensor, fully_shard, init_device_mesh
from hyper_parallel.core import comm

MODES = ("synced each", "no sync", "no all-reduce")


def build(dim, layers, mesh):
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
    for layer in net:
        fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def step(net, mode, args, s):
    for m in range(args.micro_batches):
        last = m == args.micro_batches - 1
        if mode == "no sync":
            net.set_requires_gradient_sync(last)
        elif mode == "no all-reduce":
            net.set_requires_all_reduce(last)
        torch.manual_seed(1000 * s + 10 * m + dist.get_rank())
        net(torch.randn(args.rows, args.dim)).pow(2).mean().backward()


def run(mode, mesh, args):
    net = build(args.dim, args.layers, mesh)
    times = []
    for s in range(args.warmup + args.steps):
        comm.reset_collective_counts()
        sent = comm.payload_bytes_sent()
        dist.barrier()
        start = time.perf_counter()
        step(net, mode, args, s)
        times.append(time.perf_counter() - start)
        counts = (comm.collective_count("reduce_scatter"), comm.collective_count("all_reduce"))
        sent = comm.payload_bytes_sent() - sent
        grads = [full_tensor(p, p.grad) for p in net.parameters()]
        net.zero_grad()
    return counts, sent, min(times[args.warmup:]), grads


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=64, help="rows of each rank's micro-batch")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    if os.environ.get("HP_BENCH_LINK") and "GLOO_SOCKET_IFNAME" not in os.environ:
        # Inside run_bench.sh's namespace torch's Gloo would pick the host name's address: the veth.
        links = [name for name in os.listdir("/sys/class/net") if name != "lo"]
        if len(links) == 1:
            os.environ["GLOO_SOCKET_IFNAME"] = links[0]
    dist.init_process_group("gloo")
    if dist.get_world_size() != 4:
        raise SystemExit(f"bench_accumulation: expected 4 ranks (a 2 x 2 mesh), got {dist.get_world_size()}")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    results = {mode: run(mode, mesh, args) for mode in MODES}
    if dist.get_rank() != 0:
        return
    whole = args.layers * (args.dim * args.dim + args.dim) * 4
    held = {"synced each": 0, "no sync": whole, "no all-reduce": whole // 2}
    print(f"link: {os.environ.get('HP_BENCH_LINK', 'loopback')}; {args.layers} x Linear({args.dim}, {args.dim}) fp32, "
          f"{args.micro_batches} micro-batches of {args.rows} rows per rank; best of {args.steps} steps")
    print(f"{'mode':14s} {'RS':>4s} {'AR':>4s} {'MB sent':>8s} {'MB held':>8s} {'ms/step':>8s} {'vs synced':>9s} "
          f"{'max |grad diff|':>15s}")
    base = results["synced each"]
    for mode, (counts, sent, best, grads) in results.items():
        diff = max((a - b).abs().max().item() for a, b in zip(grads, base[3]))
        print(f"{mode:14s} {counts[0]:4d} {counts[1]:4d} {sent / 1e6:8.2f} {held[mode] / 1e6:8.2f} "
              f"{best * 1e3:8.1f} {best / base[2]:8.2f}x {diff:15.2e}")
    print("MB held: what stays between micro-batches, per rank (computed from the shapes: the whole "
          "gradients, or the shard's sums over the 2 shard ranks)")


if __name__ == "__main__":
    main()
