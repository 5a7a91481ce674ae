"""MC2 on 2 ranks under hp-run, from Python, against single-process references: the fused Linear
layers forward and backward (bf16, k = out = 512, seq 8, batch 2, rtol 0.15 / atol 0.25), an MLP
against the unfused TP + SP path, fp16, batch-first Shard(1), the fused op counts, and the
Llama 3 plan of examples/torch/llama3/parallelize.py. DP x TP on a 2 x 2 mesh runs at 4 ranks."""

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hyper_parallel
from hyper_parallel import ColwiseParallel, MC2ColwiseParallel, MC2RowwiseParallel, RowwiseParallel, init_device_mesh
from hyper_parallel.core import comm
from hyper_parallel.core.dtensor.placement_types import Shard
from hyper_parallel.core.tensor_parallel.mc2 import MC2Options

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "torch", "llama3"))

RTOL, ATOL = 0.15, 0.25


def needs(world: int):
    # Evaluated at collection, before the session fixture joins the process group.
    return pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) != world, reason=f"runs on {world} ranks")


def close(actual, expected, rtol=RTOL, atol=ATOL):
    assert actual.shape == expected.shape
    diff = (actual.double() - expected.double()).abs().max().item()
    assert torch.allclose(actual.double(), expected.double(), rtol=rtol, atol=atol), f"max abs diff {diff}"


def linear(in_features, out_features, dtype, seed):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features).to(dtype)


@pytest.fixture(scope="module")
def mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))


@needs(2)
def test_colwise_forward_backward_matches_fp32_reference(mesh):
    r = dist.get_rank()
    ref, m = linear(512, 512, torch.float32, 3), linear(512, 512, torch.bfloat16, 3)
    hyper_parallel.parallelize_module(m, mesh, MC2ColwiseParallel())
    torch.manual_seed(4)
    full_x, upstream = torch.randn(2, 8, 512).bfloat16(), torch.randn(2, 8, 512).bfloat16()
    x = full_x[:, r * 4:(r + 1) * 4].clone().requires_grad_(True)
    comm.reset_collective_counts()
    y = m(x)
    assert y.shape == (2, 8, 256)
    with comm.CommRegion("backward"):
        (y * upstream[..., r * 256:(r + 1) * 256]).sum().backward()
    # The column backward runs the fused matmul-reduce-scatter exactly once.
    assert comm.collective_count("matmul_reduce_scatter", "backward") == 1
    assert comm.total_collective_count("backward") == 1
    xr = full_x.float().requires_grad_(True)
    (ref(xr) * upstream.float()).sum().backward()
    close(y, ref(full_x.float())[..., r * 256:(r + 1) * 256])
    close(x.grad, xr.grad[:, r * 4:(r + 1) * 4])
    close(m.weight.grad, ref.weight.grad[r * 256:(r + 1) * 256])
    close(m.bias.grad, ref.bias.grad[r * 256:(r + 1) * 256])


@needs(2)
def test_rowwise_forward_backward_matches_fp32_reference(mesh):
    r = dist.get_rank()
    ref, m = linear(512, 512, torch.float32, 5), linear(512, 512, torch.bfloat16, 5)
    hyper_parallel.parallelize_module(m, mesh, MC2RowwiseParallel())
    torch.manual_seed(6)
    full_x, upstream = torch.randn(2, 8, 512).bfloat16(), torch.randn(2, 8, 512).bfloat16()
    x = full_x[..., r * 256:(r + 1) * 256].clone().requires_grad_(True)
    y = m(x)
    assert y.shape == (2, 4, 512)
    (y * upstream[:, r * 4:(r + 1) * 4]).sum().backward()
    xr = full_x.float().requires_grad_(True)
    yr = ref(xr)
    (yr * upstream.float()).sum().backward()
    close(y, yr[:, r * 4:(r + 1) * 4])
    close(x.grad, xr.grad[..., r * 256:(r + 1) * 256])
    close(m.weight.grad, ref.weight.grad[:, r * 256:(r + 1) * 256])
    close(m.bias.grad, ref.bias.grad)


@needs(2)
def test_mlp_matches_the_unfused_sequence_parallel_path(mesh):
    fused = nn.Sequential(linear(512, 1024, torch.bfloat16, 11), nn.SiLU(), linear(1024, 512, torch.bfloat16, 12))
    plain = copy.deepcopy(fused)
    hyper_parallel.parallelize_module(fused, mesh, {"0": MC2ColwiseParallel(), "2": MC2RowwiseParallel()})
    hyper_parallel.parallelize_module(plain, mesh, {"0": ColwiseParallel(input_layouts=Shard(1)),
                                                    "2": RowwiseParallel(output_layouts=Shard(1))})
    torch.manual_seed(13)
    x = torch.randn(2, 4, 512).bfloat16()  # this rank's 4 of 8 tokens
    xf, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    yf, yp = fused(xf), plain(xp)
    (yf * yf.detach()).sum().backward()
    (yp * yp.detach()).sum().backward()
    close(yf, yp)
    close(xf.grad, xp.grad)
    # Gathered weight gradients.
    for i in (0, 2):
        gf = comm.all_gather(fused[i].weight.grad, 0 if i == 0 else 1, comm.world())
        gp = comm.all_gather(plain[i].weight.grad, 0 if i == 0 else 1, comm.world())
        close(gf, gp)


@needs(2)
def test_deferred_weight_grads_are_bitwise_the_serial_ones_and_arrive_after_the_hosts(mesh):
    # row -> column -> SiLU -> row: the last row's dW runs in the first row's gather window.
    def run(defer):
        model = nn.Sequential(linear(1024, 512, torch.bfloat16, 10), linear(512, 1024, torch.bfloat16, 11),
                              nn.SiLU(), linear(1024, 512, torch.bfloat16, 12))
        options = MC2Options(2, defer_weight_grads=defer)
        assert options.defer_weight_grads is defer
        hyper_parallel.parallelize_module(model, mesh, {"0": MC2RowwiseParallel(mc2_options=options),
                                                        "1": MC2ColwiseParallel(mc2_options=options),
                                                        "3": MC2RowwiseParallel(mc2_options=options)})
        order = []
        for i in (0, 1, 3):
            model[i].weight.register_hook(lambda g, i=i: order.append(i))
        torch.manual_seed(13)
        x = torch.randn(2, 8, 512).bfloat16().requires_grad_(True)  # this rank's 512 of 1024 features
        y = model(x)
        (y * y.detach()).sum().backward()
        return [x.grad] + [p.grad for p in model.parameters()], order

    deferred, deferred_order = run(True)
    serial, serial_order = run(False)
    assert serial_order == [3, 1, 0]  # each in its own node, in backward order
    assert deferred_order == [1, 0, 3]  # the last row's after the first row's gather window
    for d, s in zip(deferred, serial):
        assert torch.equal(d, s)


@needs(2)
def test_fp16_colwise(mesh):
    r = dist.get_rank()
    ref, m = linear(512, 512, torch.float32, 21), linear(512, 512, torch.float16, 21)
    hyper_parallel.parallelize_module(m, mesh, MC2ColwiseParallel())
    torch.manual_seed(22)
    full_x = torch.randn(2, 8, 512).half()
    x = full_x[:, r * 4:(r + 1) * 4].clone().requires_grad_(True)
    y = m(x)
    y.sum().backward()
    xr = full_x.float().requires_grad_(True)
    ref(xr).sum().backward()
    assert y.dtype == torch.float16
    close(y, ref(full_x.float())[..., r * 256:(r + 1) * 256])
    close(x.grad, xr.grad[:, r * 4:(r + 1) * 4])


@needs(2)
def test_batch_first_shard1_equals_sequence_first_shard0(mesh):
    a, b = linear(512, 512, torch.bfloat16, 31), linear(512, 512, torch.bfloat16, 31)
    hyper_parallel.parallelize_module(a, mesh, MC2ColwiseParallel(input_layouts=Shard(0)))
    hyper_parallel.parallelize_module(b, mesh, MC2ColwiseParallel(input_layouts=Shard(1)))
    torch.manual_seed(32)
    x = torch.randn(2, 4, 512).bfloat16()
    assert torch.equal(a(x.transpose(0, 1).contiguous()).transpose(0, 1), b(x))


@needs(2)
def test_llama_plan_disabled_is_the_hand_written_plan_bitwise_and_enabled_trains_alike(mesh):
    import model as llama
    import parallelize as plan

    args = llama.ModelArgs.small()
    tokens = llama.synthetic_batch(3, 1, 2, args.max_seq_len, args.vocab_size)[:, :args.max_seq_len]

    def fresh():
        torch.manual_seed(3)
        return llama.Transformer(args).to(torch.bfloat16)

    by_plan, by_hand = fresh(), fresh()
    plan.parallelize_llama3(by_plan, mesh, enable_mc2=False)
    hyper_parallel.parallelize_module(by_hand, mesh, plan.hand_written_plain_plan())
    assert torch.equal(by_plan(tokens), by_hand(tokens))

    # Training: a few AdamW steps, fused vs plain, losses within bf16 tolerance.
    losses = {}
    for enable_mc2 in (False, True):
        model = fresh()
        plan.parallelize_llama3(model, mesh, enable_mc2=enable_mc2)
        comm.reset_collective_counts()
        losses[enable_mc2] = llama.train_steps(model, args, steps=3)
        fused_ops = comm.collective_count("all_gather_matmul") + comm.collective_count("matmul_reduce_scatter")
        assert (fused_ops > 0) == enable_mc2
    for plain_loss, fused_loss in zip(losses[False], losses[True]):
        assert abs(fused_loss - plain_loss) <= 1e-2 * abs(plain_loss)
    with pytest.raises(ValueError, match="enable_mc2 requires sequence parallelism"):
        plan.parallelize_llama3(fresh(), mesh, enable_mc2=True, enable_sequence_parallel=False)


@needs(4)
def test_dp_times_tp_on_a_2x2_mesh():
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_mesh = mesh2d["tp"]
    t = tp_mesh.get_local_rank()
    fused = nn.Sequential(linear(512, 1024, torch.bfloat16, 41), nn.SiLU(), linear(1024, 512, torch.bfloat16, 42))
    ref = copy.deepcopy(fused).float()
    hyper_parallel.parallelize_module(fused, tp_mesh, {"0": MC2ColwiseParallel(), "2": MC2RowwiseParallel()})
    torch.manual_seed(43)  # both DP replicas take the same batch
    full_x = torch.randn(2, 8, 512)
    x = full_x[:, t * 4:(t + 1) * 4].bfloat16().requires_grad_(True)
    y = fused(x)
    y.float().sum().backward()
    xr = full_x.clone().requires_grad_(True)
    yr = ref(xr)
    yr.sum().backward()
    close(y, yr[:, t * 4:(t + 1) * 4])
    close(x.grad, xr.grad[:, t * 4:(t + 1) * 4])
    close(fused[0].weight.grad, ref[0].weight.grad[t * 512:(t + 1) * 512])
