"""Two MC2 column layers reading one activation (Llama's w1 and w3) share its gather, on 2 and 4
ranks: the second layer reuses the first's only where its input gradient flows where the gather's
goes. A gather made under no_grad, in a reentrant checkpoint's forward, of a detached view, or of
another leaf over the same storage is made again, and every gradient matches one process."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as checkpoint
from torch import nn

from hyper_parallel import MC2ColwiseParallel, init_device_mesh, parallelize_module
from hyper_parallel.core import comm
from hyper_parallel.core.tensor_parallel.mc2 import MC2Contract

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
pytestmark = pytest.mark.skipif(WORLD < 2, reason="needs 2 or more ranks")
ROWS = 4  # sequence rows per rank


@pytest.fixture(scope="module")
def mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))


def both(x, m):
    return m.w1(x), m.w3(x)


def no_grad_first(x, m):
    with torch.no_grad():
        a = m.w1(x)
    return a, m.w3(x)


def reentrant_first(x, m):
    return checkpoint.checkpoint(m.w1, x, use_reentrant=True), m.w3(x)


def non_reentrant_first(x, m):
    return checkpoint.checkpoint(m.w1, x, use_reentrant=False), m.w3(x)


def detached_first(x, m):
    return m.w1(x.detach()), m.w3(x)


# (forward, the all_gather_matmul ops its forward runs: 1 where w3 reuses w1's gather)
CASES = {
    "both read x": (both, 1),
    "w1 under no_grad": (no_grad_first, 2),
    "w1 in a reentrant checkpoint": (reentrant_first, 2),
    "w1 in a non-reentrant checkpoint": (non_reentrant_first, 1),
    "w1 of x.detach()": (detached_first, 2),
}


def models(mesh):
    torch.manual_seed(0)
    ref = nn.ModuleDict(dict(w1=nn.Linear(8, 16), w3=nn.Linear(8, 16)))
    net = copy.deepcopy(ref)
    style = MC2ColwiseParallel(contract=MC2Contract.relaxed())
    parallelize_module(net, mesh, {"w1": style, "w3": style})
    return ref, net


def inputs(requires_grad=True):
    """The full activation, and this rank's rows of its sequence dim (dim 1)."""
    torch.manual_seed(1)
    full = torch.randn(2, ROWS * WORLD, 8)
    r = dist.get_rank()
    local = full[:, r * ROWS:(r + 1) * ROWS].clone().requires_grad_(requires_grad)
    return full.requires_grad_(requires_grad), local


def loss(a, c):
    """The sum over ranks of each rank's loss of its feature shards is the full loss."""
    return (a * c).sum()


def gathered_rows(grad):
    """This rank's rows of a full-sequence gradient."""
    r = dist.get_rank()
    return grad[:, r * ROWS:(r + 1) * ROWS]


def full_weight_grad(mesh, p):
    parts = [torch.empty_like(p.grad) for _ in range(WORLD)]
    dist.all_gather(parts, p.grad.contiguous())
    return torch.cat(parts, 0)


@pytest.mark.parametrize("case", list(CASES))
def test_every_gradient_matches_one_process(mesh, case):
    forward, ops = CASES[case]
    ref, net = models(mesh)
    full, local = inputs()
    comm.reset_collective_counts()
    out = loss(*forward(local, net))
    assert comm.collective_count("all_gather_matmul") == ops
    out.backward()
    loss(*forward(full, ref)).backward()
    torch.testing.assert_close(local.grad, gathered_rows(full.grad), rtol=1e-5, atol=1e-6)
    for name in ("w1", "w3"):
        want = ref[name].weight.grad
        if want is None:  # w1 under no_grad
            assert net[name].weight.grad is None
            continue
        torch.testing.assert_close(full_weight_grad(mesh, net[name].weight), want, rtol=1e-5, atol=1e-6)


def test_a_leaf_over_the_same_storage_keeps_its_own_gradient(mesh):
    """``a = x.detach().requires_grad_()`` is another leaf: its gradient is w1's, x's is w3's."""
    ref, net = models(mesh)
    full, local = inputs()
    alias_full, alias_local = full.detach().requires_grad_(), local.detach().requires_grad_()
    comm.reset_collective_counts()
    out = loss(net.w1(alias_local), net.w3(local))
    assert comm.collective_count("all_gather_matmul") == 2
    out.backward()
    loss(ref.w1(alias_full), ref.w3(full)).backward()
    torch.testing.assert_close(local.grad, gathered_rows(full.grad), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(alias_local.grad, gathered_rows(alias_full.grad), rtol=1e-5, atol=1e-6)


def test_an_eval_forward_shares_the_gather(mesh):
    ref, net = models(mesh)
    full, local = inputs(requires_grad=False)
    comm.reset_collective_counts()
    with torch.no_grad():
        a, c = both(local, net)
    assert comm.collective_count("all_gather_matmul") == 1
    want_a, want_c = both(full, ref)
    cols = slice(dist.get_rank() * 16 // WORLD, (dist.get_rank() + 1) * 16 // WORLD)
    torch.testing.assert_close(a, want_a[..., cols].detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c, want_c[..., cols].detach(), rtol=1e-5, atol=1e-6)
