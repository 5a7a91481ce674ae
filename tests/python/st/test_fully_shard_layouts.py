"""A layout a tensor-parallel style tags on its output (``use_local_output=False``) crosses
fully_shard's wrappers: the pre-backward node on a sharded module's outputs, the post-backward
node on its inputs, and the mixed-precision casts. The next style reads it (a Shard(0) activation
into a column layer), and ``loss_parallel`` finds the vocabulary-sharded logits of a head in a
fully_shard group, also when the model returns logits computed from them (scaled, cast). Against
a single-process reference on a (dp, 2) mesh: (1, 2) at 2 ranks, (2, 2) at 4."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyper_parallel import (ColwiseParallel, MixedPrecisionPolicy, RowwiseParallel, SequenceParallel, full_tensor,
                            fully_shard, init_device_mesh, loss_parallel, parallelize_module)
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard

ROWS, VOCAB, DIM, SEQ = 4, 24, 8, 6


@pytest.fixture
def mesh():
    ws = dist.get_world_size()
    if ws % 2:
        pytest.skip("a (dp, 2) mesh needs an even world size")
    return init_device_mesh("cpu", (ws // 2, 2), mesh_dim_names=("dp", "tp"))


def full_grads(model):
    return {name: full_tensor(p, p.grad) for name, p in model.named_parameters()}


def expect_close(got, want):
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def four_linears():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(12, 20), nn.Linear(20, 12), nn.Linear(12, 20), nn.Linear(20, 12))


# The second layer's output stays row-sharded (Shard(0), tagged); the third reads that layout.
ROW_SHARDED_BETWEEN = {"0": ColwiseParallel(), "1": RowwiseParallel(output_layouts=Shard(0), use_local_output=False),
                       "2": ColwiseParallel(), "3": RowwiseParallel()}
MIXED = {"none": MixedPrecisionPolicy(),
         "f64_params": MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float32),
         "f64_params_f32_outputs": MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float32,
                                                        output_dtype=torch.float32)}


@pytest.mark.parametrize("mp", list(MIXED))
@pytest.mark.parametrize("groups", ["each_layer", "pairs"])
def test_a_tagged_activation_crosses_fully_shard_modules(mesh, groups, mp):
    dp = mesh["dp"].get_local_rank()
    torch.manual_seed(5)
    x = torch.randn(mesh["dp"].size() * ROWS, 12)
    reference = four_linears()
    reference(x).pow(2).sum().div(mesh["dp"].size()).backward()
    net = parallelize_module(four_linears(), mesh["tp"], ROW_SHARDED_BETWEEN)
    shard = [net[i] for i in range(4)] if groups == "each_layer" else [net[1], net[2]]
    for m in shard:
        fully_shard(m, mesh=mesh["dp"], mp_policy=MIXED[mp])
    fully_shard(net, mesh=mesh["dp"], mp_policy=MIXED[mp])
    y = net(x[dp * ROWS:][:ROWS])
    assert y.shape == (ROWS, 12)
    torch.testing.assert_close(y.double(), reference(x[dp * ROWS:][:ROWS]).double(), rtol=1e-5, atol=1e-6)
    y.pow(2).sum().backward()
    expect_close(full_grads(net), {n: p.grad for n, p in reference.named_parameters()})


LOGITS = {"as_they_are": lambda logits: logits, "scaled": lambda logits: logits / 0.7,
          "cast": lambda logits: logits.double()}


class TinyLM(nn.Module):
    """Returns the head's logits, or logits computed from them (a temperature, a cast up)."""

    def __init__(self, logits="as_they_are"):
        super().__init__()
        torch.manual_seed(7)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.logits = LOGITS[logits]

    def forward(self, ids):
        return self.logits(self.out(self.norm(self.emb(ids))))


LM_PLAN = {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)), "norm": SequenceParallel(),
           "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}


@pytest.mark.parametrize("logits", list(LOGITS))
@pytest.mark.parametrize("head", ["root_group", "own_group"])
def test_loss_parallel_finds_the_logits_of_a_head_under_fully_shard(mesh, head, logits):
    dp, replicas = mesh["dp"].get_local_rank(), mesh["dp"].size()
    torch.manual_seed(9)
    ids, labels = torch.randint(VOCAB, (2, replicas * ROWS, SEQ))
    reference = TinyLM(logits)
    losses = [F.cross_entropy(reference(ids[r * ROWS:][:ROWS]).flatten(0, 1), labels[r * ROWS:][:ROWS].flatten())
              for r in range(replicas)]
    (sum(losses) / replicas).backward()
    net = parallelize_module(TinyLM(logits), mesh["tp"], LM_PLAN)
    if head == "own_group":
        fully_shard(net.out, mesh=mesh["dp"])
    fully_shard(net, mesh=mesh["dp"])
    logits = net(ids[dp * ROWS:][:ROWS])
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), labels[dp * ROWS:][:ROWS].flatten())
    torch.testing.assert_close(loss, losses[dp].to(loss.dtype), rtol=1e-5, atol=1e-6)
    loss.backward()
    expect_close(full_grads(net), {n: p.grad for n, p in reference.named_parameters()})
