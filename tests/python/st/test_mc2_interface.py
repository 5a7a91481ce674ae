"""The original's mc2 interface on 2 and 4 ranks, against single-process float64 references:
AllGatherMatmulFunction and MatmulReduceScatterFunction forward and backward in bf16 and fp16,
over a group from dist.new_group and over mesh.get_group(); an MC2Linear configured by hand with
a torch group (sequence_dim defaulting to 0); mesh groups in torch.distributed's own calls."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel import init_device_mesh
from hyper_parallel.core import comm
from hyper_parallel.core.tensor_parallel.mc2 import (
    AllGatherMatmulFunction,
    MatmulReduceScatterFunction,
    MC2Contract,
    MC2Linear,
    get_hcomm_info,
)

# Against float64 on the same 16-bit inputs, with values of order 1: the fused op rounds each
# output element once or twice (the bias is added after the collective; fp16 matmuls run in
# float32 on CPU), the reductions accumulate in float32.
TOLERANCE = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
multirank = pytest.mark.skipif(WORLD < 2, reason="needs 2 or more ranks")


def close(actual, expected, dtype):
    """Within the dtype's tolerance, the absolute part scaled by the reference's magnitude."""
    rtol, atol = TOLERANCE[dtype]
    scale = expected.abs().max().item()
    assert actual.dtype == dtype and actual.shape == expected.shape
    diff = (actual.double() - expected).abs().max().item()
    assert torch.allclose(actual.double(), expected, rtol=rtol, atol=atol * scale), \
        f"max abs diff {diff} (scale {scale})"


@pytest.fixture(scope="module")
def mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))


@pytest.fixture(scope="module")
def new_group():
    return dist.new_group(list(range(dist.get_world_size())))


def groups(mesh, new_group):
    return {"dist.new_group": new_group, "mesh.get_group()": mesh.get_group()}


def data(dtype, *shapes, seed):
    """The same full tensors on every rank, scaled so that products over the last dim stay of
    order 1."""
    torch.manual_seed(seed)
    return [(torch.randn(*s, dtype=torch.float64) / s[-1] ** 0.5).to(dtype) for s in shapes]


@multirank
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("which", ["dist.new_group", "mesh.get_group()"])
def test_all_gather_matmul_function(mesh, new_group, dtype, which):
    group, p, r = groups(mesh, new_group)[which], dist.get_world_size(), dist.get_rank()
    m, k, n = 3, 64, 16  # rows per rank, in, out per rank
    x_full, w_full, b_full, dy_full = data(dtype, (p * m, k), (p * n, k), (p * n,), (p * m, p * n), seed=1)
    x = x_full[r * m:(r + 1) * m].clone().requires_grad_(True)
    w = w_full[r * n:(r + 1) * n].clone().requires_grad_(True)
    b = b_full[r * n:(r + 1) * n].clone().requires_grad_(True)
    comm.reset_collective_counts()
    y = AllGatherMatmulFunction.apply(x, w, group, p, b)
    y.backward(dy_full[:, r * n:(r + 1) * n])
    assert comm.collective_count("all_gather_matmul") == 1 and comm.collective_count("matmul_reduce_scatter") == 1
    xr, wr, br = (t.double().requires_grad_(True) for t in (x_full, w_full, b_full))
    yr = xr @ wr.t() + br
    yr.backward(dy_full.double())
    close(y, yr[:, r * n:(r + 1) * n].detach(), dtype)
    close(x.grad, xr.grad[r * m:(r + 1) * m], dtype)
    close(w.grad, wr.grad[r * n:(r + 1) * n], dtype)
    close(b.grad, br.grad[r * n:(r + 1) * n], dtype)


@multirank
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("which", ["dist.new_group", "mesh.get_group()"])
def test_matmul_reduce_scatter_function(mesh, new_group, dtype, which):
    group, p, r = groups(mesh, new_group)[which], dist.get_world_size(), dist.get_rank()
    m, k, n = 3, 16, 32  # rows per rank after the scatter, in per rank, out
    x_full, w_full, b_full, dy_full = data(dtype, (p * m, p * k), (n, p * k), (n,), (p * m, n), seed=2)
    x = x_full[:, r * k:(r + 1) * k].clone().requires_grad_(True)
    w = w_full[:, r * k:(r + 1) * k].clone().requires_grad_(True)
    b = b_full.clone().requires_grad_(True)
    y = MatmulReduceScatterFunction.apply(x, w, group, p, b)
    y.backward(dy_full[r * m:(r + 1) * m])
    xr, wr, br = (t.double().requires_grad_(True) for t in (x_full, w_full, b_full))
    yr = xr @ wr.t() + br
    yr.backward(dy_full.double())
    close(y, yr[r * m:(r + 1) * m].detach(), dtype)
    close(x.grad, xr.grad[:, r * k:(r + 1) * k], dtype)
    close(w.grad, wr.grad[:, r * k:(r + 1) * k], dtype)
    close(b.grad, br.grad, dtype)


@multirank
def test_functions_reject_a_world_size_that_is_not_the_groups(new_group):
    p = dist.get_world_size()
    x, w = torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(4, 8, dtype=torch.bfloat16)
    message = rf"AllGatherMatmulFunction: expected world_size to equal the group's size \({p}\), got {p + 1}"
    with pytest.raises(ValueError, match=message):
        AllGatherMatmulFunction.apply(x, w, new_group, p + 1, None)


@multirank
def test_mc2_linear_configured_by_hand_with_a_torch_group(new_group):
    """Sequence-first activations [S/P, B, H]: sequence_dim defaults to 0."""
    p, r, dtype = dist.get_world_size(), dist.get_rank(), torch.bfloat16
    torch.manual_seed(3)
    ref = nn.Linear(64, 16 * p).double()
    layer = MC2Linear(64, 16).to(dtype)  # this rank's 16 output features
    with torch.no_grad():
        layer.weight.copy_(ref.weight[r * 16:(r + 1) * 16].to(dtype))
        layer.bias.copy_(ref.bias[r * 16:(r + 1) * 16].to(dtype))
    layer.configure_mc2("all_gather", new_group, p, contract=MC2Contract.relaxed())
    assert layer.mc2_sequence_dim == 0 and layer.mc2_group is new_group
    x_full, dy_full = data(dtype, (2 * p, 3, 64), (2 * p, 3, 16 * p), seed=4)
    x = x_full[r * 2:(r + 1) * 2].clone().requires_grad_(True)
    y = layer(x)
    assert y.shape == (2 * p, 3, 16)
    y.backward(dy_full[..., r * 16:(r + 1) * 16])
    xr = x_full.double().requires_grad_(True)
    yr = ref(xr)
    yr.backward(dy_full.double())
    close(y, yr[..., r * 16:(r + 1) * 16].detach(), dtype)
    close(x.grad, xr.grad[r * 2:(r + 1) * 2], dtype)
    close(layer.weight.grad, ref.weight.grad[r * 16:(r + 1) * 16], dtype)


@multirank
def test_a_negative_sequence_dim_counts_from_the_end_of_the_leading_dims(new_group):
    """[B, S/P, H] with sequence_dim=-1 (the original's convention) equals sequence_dim=1."""
    p, dtype = dist.get_world_size(), torch.bfloat16
    torch.manual_seed(5)
    a = MC2Linear(32, 8).to(dtype)
    b = MC2Linear(32, 8).to(dtype)
    with torch.no_grad():
        b.weight.copy_(a.weight)
        b.bias.copy_(a.bias)
    a.configure_mc2("all_gather", new_group, p, -1, contract=MC2Contract.relaxed())
    b.configure_mc2("all_gather", new_group, p, 1, contract=MC2Contract.relaxed())
    x = torch.randn(2, 3, 32).to(dtype)
    assert torch.equal(a(x), b(x))
    assert a(x).shape == (2, 3 * p, 8)


@multirank
def test_mesh_groups_work_with_torch_distributed(mesh):
    group, p = mesh.get_group(), dist.get_world_size()
    assert dist.get_rank(group) == dist.get_rank() and dist.get_world_size(group) == p
    t = torch.full((3,), float(dist.get_rank()))
    dist.all_reduce(t, group=group)
    assert torch.equal(t, torch.full((3,), float(sum(range(p)))))
    names = [None] * p
    dist.all_gather_object(names, get_hcomm_info(group))
    assert names[0] and len(set(names)) == 1


@pytest.mark.skipif(WORLD != 4, reason="runs on 4 ranks")
def test_sub_mesh_groups_on_a_2x2_mesh():
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh2d.get_group("tp"), mesh2d.get_group("dp")
    rank = dist.get_rank()
    assert dist.get_world_size(tp) == 2 and dist.get_rank(tp) == rank % 2
    assert dist.get_world_size(dp) == 2 and dist.get_rank(dp) == rank // 2
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=tp)
    assert t.item() == (rank // 2) * 4 + 1  # the two ranks of this tp line
    assert mesh2d["tp"].get_group() is tp
    names = [None] * 4
    dist.all_gather_object(names, get_hcomm_info(tp))
    assert names[0] == names[1] and names[2] == names[3] and names[0] != names[2]
    # The fused op over the torch sub-group.
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    y = AllGatherMatmulFunction.apply(x, torch.ones(4, 8, dtype=torch.bfloat16), tp, 2, None)
    assert y.shape == (4, 4) and torch.equal(y, torch.full((4, 4), 8.0, dtype=torch.bfloat16))


@multirank
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_functions_hand_back_gradients_in_their_inputs_layout(new_group, transposed):
    """Each gradient in the memory layout of its input (docs/known-torch-bugs.md): a transposed
    x gets a transposed gradient, as torch's own mm backward gives it, a contiguous one a
    contiguous gradient. Read where autograd hands it on, before any accumulation."""
    ws, k, n = dist.get_world_size(), 256, 256
    torch.manual_seed(60)
    for function, rows in ((AllGatherMatmulFunction, 4), (MatmulReduceScatterFunction, 4 * ws)):
        leaf = torch.randn(k, rows).bfloat16().requires_grad_(True) if transposed else \
            torch.randn(rows, k).bfloat16().requires_grad_(True)
        x = leaf.t() if transposed else leaf * 1
        w = torch.randn(n, k).bfloat16().requires_grad_(True)
        seen = {}
        x.register_hook(lambda g: seen.update(x=g))
        w.register_hook(lambda g: seen.update(w=g))
        y = function.apply(x, w, new_group, ws, None)
        y.backward(torch.randn_like(y))
        assert seen["x"].shape == x.shape and seen["x"].stride() == x.stride(), function.__name__
        assert seen["w"].stride() == w.stride(), function.__name__


@multirank
def test_parallelized_in_float32_then_cast_to_bfloat16_runs():
    """PyTorch users often parallelize in float32, then cast: the kernel's dtype limit is checked
    when a layer runs, naming it, so that order works and gives the bits of a model parallelized
    in bfloat16."""
    from hyper_parallel import MC2ColwiseParallel, MC2RowwiseParallel, parallelize_module

    def mlp(dtype):
        torch.manual_seed(70)
        return nn.Sequential(nn.Linear(512, 256 * WORLD), nn.SiLU(), nn.Linear(256 * WORLD, 512)).to(dtype)

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    plan = {"0": MC2ColwiseParallel(), "2": MC2RowwiseParallel()}
    cast_after, bf16 = mlp(torch.float32), mlp(torch.bfloat16)
    parallelize_module(cast_after, mesh, plan)
    parallelize_module(bf16, mesh, {"0": MC2ColwiseParallel(), "2": MC2RowwiseParallel()})
    torch.manual_seed(71)
    x = torch.randn(2, 4, 512)
    with pytest.raises(ValueError, match=r"MC2Linear\(0\)::forward: MC2 dtype: expected one of \{Half, BFloat16\}, "
                                         r"got Float"):
        cast_after(x)
    cast_after.to(torch.bfloat16)
    y = cast_after(x.bfloat16())
    assert torch.equal(y, bf16(x.bfloat16()))
    y.float().sum().backward()
    assert cast_after[0].weight.grad.dtype == torch.bfloat16


@multirank
def test_meshes_and_groups_are_duck_typed(new_group):
    """Any mesh with get_group() and size() serves (the original needs no more); a group handle
    configure_mc2 cannot use is an error naming the layer when it first runs."""
    from hyper_parallel import MC2ColwiseParallel, parallelize_module

    class AnyMesh:
        def get_group(self):
            return new_group

        def size(self):
            return WORLD

    torch.manual_seed(72)
    layer = nn.Linear(512, 256 * WORLD).bfloat16()
    parallelize_module(layer, AnyMesh(), {"": MC2ColwiseParallel()})
    assert layer.mc2_group is new_group and layer.weight.shape == (256, 512)
    assert layer(torch.randn(2, 4, 512).bfloat16()).shape == (2, 4 * WORLD, 256)
    bad = MC2Linear.from_linear(nn.Linear(512, 256).bfloat16())
    bad.configure_mc2("all_gather", "tp-group", WORLD, sequence_dim=1)
    assert bad.mc2_group == "tp-group"
    with pytest.raises(TypeError, match=r"MC2Linear \(in_features=512, out_features=256\): the group given to "
                                        r"configure_mc2 cannot run the fused op: .*got str"):
        bad(torch.randn(2, 4, 512).bfloat16())


@multirank
def test_a_torch_group_keeps_one_call_order_whichever_ranks_hold_it():
    """The core adopts a torch group once, for the life of the world: its call order (and its
    link estimate, which auto chunking measures) do not restart on a rank that dropped its handle
    while another rank kept one, as Python's collector may arrange."""
    import hyper_parallel._C as C

    group = dist.new_group(list(range(WORLD)))
    held = C.as_group(group) if dist.get_rank() == 0 else None
    for _ in range(3):
        assert C.all_reduce(torch.ones(2), C.ReduceOp.SUM, group).tolist() == [WORLD, WORLD]
    del held


@multirank
def test_a_torch_group_destroyed_by_torch_releases_its_threads():
    """Once torch.distributed.destroy_process_group(group) and every handle let a group go, the
    core lets go of it too: a loop of short-lived groups keeps its threads (and connections)."""
    import hyper_parallel._C as C

    def threads():
        return len(os.listdir("/proc/self/task"))

    def one_short_lived_group():
        group = dist.new_group(list(range(WORLD)))
        assert C.all_reduce(torch.ones(1), C.ReduceOp.SUM, group).item() == WORLD
        dist.destroy_process_group(group)

    import time

    def threads_once_released(limit):  # a thread of the core's own destroys released groups
        deadline = time.monotonic() + 10
        while threads() > limit and time.monotonic() < deadline:
            time.sleep(0.05)
        return threads()

    for _ in range(2):
        one_short_lived_group()
    time.sleep(0.5)  # the release of the first group is done
    before = threads()
    for _ in range(8):
        one_short_lived_group()
    assert threads_once_released(before) <= before


@multirank
def test_a_released_group_is_destroyed_off_the_thread_that_adopts_the_next():
    """A callback of torch's work on a group runs on that group's own worker thread. There, the
    first call on another group adopts it, after torch destroyed the first group: the core must
    not release the first group on that thread (its destructor joins the thread)."""
    import time

    import hyper_parallel._C as C

    group = dist.new_group(list(range(WORLD)))
    C.all_reduce(torch.ones(1), C.ReduceOp.SUM, group)  # adopted
    other = dist.new_group(list(range(WORLD)))
    results = []

    def first_use_of_other(_):
        results.append(C.all_reduce(torch.ones(1), C.ReduceOp.SUM, other).item())

    if dist.get_rank() == 1:
        time.sleep(1)  # rank 0's work is still running when its callback is attached
    work = dist.all_reduce(torch.ones(1), group=group, async_op=True)
    future = work.get_future().then(first_use_of_other)
    dist.destroy_process_group(group)
    del group, work
    future.wait()
    assert results == [WORLD]


@multirank
def test_a_double_backward_through_the_fused_ops_is_refused_by_name():
    """A gradient penalty (create_graph=True) would differentiate out= matmuls: a clear error."""
    from hyper_parallel import MC2ColwiseParallel, MC2RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    parallelize_module(mlp, mesh, {"0": MC2ColwiseParallel(contract=MC2Contract.relaxed()),
                                   "1": MC2RowwiseParallel(contract=MC2Contract.relaxed())})
    x = torch.randn(2, 2, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="got create_graph=True"):
        torch.autograd.grad(mlp(x).square().sum(), x, create_graph=True)
    (g,) = torch.autograd.grad(mlp(x).square().sum(), x)  # without it, as before
    assert g.shape == x.shape
