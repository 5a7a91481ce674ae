"""SequenceParallel on a module whose parameters live in its submodules (a norm wrapper, an
nn.Sequential), as torch's style takes it: every parameter of the subtree stays replicated and the
gradient of the forward on it is summed over tp once, whether the submodule's forward reads it or
the wrapper reads it itself, with a loss term on the parameters counted once, also after a forward
that summed nothing (no_grad, frozen); the same under
fully_shard over dp on a 2 x 2 mesh, with the submodule sharded alone or with the model. Against
a single-process reference at 2 and 4 ranks."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyper_parallel import (ColwiseParallel, SequenceParallel, full_tensor, fully_shard, init_device_mesh,
                            parallelize_module)
from hyper_parallel.core.dtensor.placement_types import Shard

BATCH, TOKENS_PER_RANK, DIM, OUT = 2, 3, 8, 6


def spread_layer_norm(ln):
    with torch.no_grad():  # away from the defaults, so a gradient counted wrong shows
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.5, 0.5)
    return ln


class CallsChild(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = spread_layer_norm(nn.LayerNorm(DIM))

    def forward(self, x):
        return self.ln(x)


class ReadsChild(CallsChild):
    """Reads its submodule's parameters itself, without calling it."""

    def forward(self, x):
        return F.layer_norm(x, (DIM,), self.ln.weight, self.ln.bias)


class TwoLevels(nn.Module):
    """Its own scale, and a LayerNorm two levels down, the same LayerNorm applied twice."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, DIM))
        ln = spread_layer_norm(nn.LayerNorm(DIM))
        self.inner = nn.Sequential(ln, nn.GELU(), ln)

    def forward(self, x):
        return self.inner(x) * self.scale


NORMS = {"calls_child": CallsChild, "reads_child": ReadsChild, "two_levels": TwoLevels,
         "sequential": lambda: nn.Sequential(spread_layer_norm(nn.LayerNorm(DIM)), nn.Tanh())}


class NormThenColumn(nn.Module):
    def __init__(self, norm):
        super().__init__()
        torch.manual_seed(11)
        self.norm = NORMS[norm]()
        self.proj = nn.Linear(DIM, OUT)

    def forward(self, x):
        return self.proj(self.norm(x))


def loss(model, x):
    """A data term and a penalty on the norm's parameters (every rank computes it alike)."""
    return model(x).pow(2).sum() + 0.1 * sum(p.pow(2).sum() for p in model.norm.parameters())


def tokens(tp_size, replicas=1):
    torch.manual_seed(5)
    return torch.randn(replicas, BATCH, tp_size * TOKENS_PER_RANK, DIM)


def my_tokens(x, tp_rank):
    return x.narrow(1, tp_rank * TOKENS_PER_RANK, TOKENS_PER_RANK)


def parallelize(model, tp_mesh):
    return parallelize_module(model, tp_mesh, {"norm": SequenceParallel(),
                                               "proj": ColwiseParallel(input_layouts=Shard(1))})


def expect_reference_grads(model, norm, x, scale=1.0):
    """``model``'s gradients are ``scale`` times those of the mean loss over x's replicas in one process."""
    ref = NormThenColumn(norm)
    (sum(loss(ref, x[i]) for i in range(x.size(0))) / x.size(0)).backward()
    expected = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(full_tensor(p, p.grad), scale * expected[name].grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("before", ["nothing", "no_grad_forward", "frozen_forward"])
@pytest.mark.parametrize("norm", list(NORMS))
def test_sequence_parallel_sums_the_gradients_of_its_submodules_parameters(norm, before):
    """Also after a forward that summed nothing (an evaluation, the parameters frozen)."""
    ws = dist.get_world_size()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    x = tokens(ws)
    model = parallelize(NormThenColumn(norm), mesh)
    for p in model.norm.parameters():
        assert p.shape == (DIM,)  # replicated
    if before == "no_grad_forward":
        with torch.no_grad():
            model(my_tokens(x[0], mesh.get_local_rank()))
    elif before == "frozen_forward":
        model.requires_grad_(False)
        model(my_tokens(x[0], mesh.get_local_rank()))
        model.requires_grad_(True)
    loss(model, my_tokens(x[0], mesh.get_local_rank())).backward()
    expect_reference_grads(model, norm, x)
    assert all(isinstance(p, nn.Parameter) for p in model.norm.parameters())  # put back after the call


@pytest.mark.parametrize("sharded", ["norm", "norm_child", "model"])
@pytest.mark.parametrize("norm", ["calls_child", "two_levels"])
def test_sequence_parallel_submodules_under_fully_shard_on_a_2x2_mesh(norm, sharded):
    if dist.get_world_size() != 4:
        pytest.skip("a 2 x 2 (dp, tp) mesh needs 4 ranks")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    x = tokens(2, replicas=2)
    model = parallelize(NormThenColumn(norm), mesh["tp"])
    if sharded == "norm":
        fully_shard(model.norm, mesh=mesh["dp"])
    elif sharded == "norm_child":  # a submodule of the styled module, gathered by its own pre-hook
        fully_shard(model.norm.ln if norm == "calls_child" else model.norm.inner[0], mesh=mesh["dp"])
    model = fully_shard(model, mesh=mesh["dp"])
    for _ in range(2):  # the second backward accumulates
        loss(model, my_tokens(x[dp], tp)).backward()
    expect_reference_grads(model, norm, x, scale=2.0)
