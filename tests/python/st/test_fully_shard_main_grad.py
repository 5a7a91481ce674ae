"""MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True), HyperParallel's option: each shard's
reduced gradient is added to the parameter's ``main_grad`` in the reduce dtype, and ``.grad`` is
left as it is. Against the full-batch single-process reference: shards over the world (one
reduce-scatter per group and in buckets) and HSDP, sums over backwards and over unsynced
micro-batches, bf16 shards whose main_grad keeps the fp32 reduction, zero_grad; and the errors
the option can cause."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel import FSDPModule, MixedPrecisionPolicy, fully_shard, init_device_mesh

from fully_shard_models import DIM, Block

ROWS_PER_RANK = 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, 2)  # 2 rows: empty pieces at 4 ranks

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def shard(net, mesh=None, comm_fusion=True, **policy):
    options = dict(mesh=mesh, comm_fusion=comm_fusion,
                   mp_policy=MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True, **policy))
    for b in net.blocks:
        fully_shard(b, **options)
    return fully_shard(net, **options)


def batch(step, dtype=torch.float32):
    torch.manual_seed(300 + step)
    return torch.randn(dist.get_world_size() * ROWS_PER_RANK, DIM, dtype=dtype)


def rows_of(x, rank):
    return x[rank * ROWS_PER_RANK:][:ROWS_PER_RANK]


def loss(net, x):
    """The reference's mean over the batch; a rank's over its rows (the ranks' gradients are
    averaged)."""
    rows = ROWS_PER_RANK if isinstance(net, FSDPModule) else dist.get_world_size() * ROWS_PER_RANK
    return net(x).float().pow(2).sum() / rows


def piece(full, shards):
    """This rank's torch.chunk piece of ``full`` over a shard dim of ``shards`` ranks (the last
    dim of a row-major mesh)."""
    chunks, index = full.chunk(shards), dist.get_rank() % shards
    return chunks[index] if index < len(chunks) else full[:0]


def assert_main_grads(net, reference, shards):
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        assert p.grad is None, name
        assert p.main_grad.dtype == torch.float32, name
        torch.testing.assert_close(p.main_grad, piece(q.grad, shards), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("comm_fusion", [True, False], ids=["one_reduce_scatter", "buckets"])
def test_main_grad_sums_the_backwards_and_zero_grad_clears_it(comm_fusion):
    reference, net = Net(), shard(Net(), comm_fusion=comm_fusion)
    for s in range(2):  # no zero_grad between them: both add up
        loss(reference, batch(s)).backward()
        loss(net, rows_of(batch(s), dist.get_rank())).backward()
    assert_main_grads(net, reference, dist.get_world_size())
    net.zero_grad(set_to_none=False)
    assert all(p.main_grad.abs().sum() == 0 for p in net.parameters())
    net.zero_grad()
    assert all(p.main_grad is None for p in net.parameters())
    reference.zero_grad()
    loss(reference, batch(2)).backward()
    loss(net, rows_of(batch(2), dist.get_rank())).backward()
    assert_main_grads(net, reference, dist.get_world_size())


def test_main_grad_is_added_to_in_place():
    """A buffer the caller made (Megatron's), and one zero_grad(set_to_none=False) zeroed, gets
    the gradient: what an optimizer holding it reads."""
    reference, net = Net(), shard(Net())
    buffers = []
    for p in net.parameters():
        p.main_grad = torch.zeros(p.shape)
        buffers.append(p.main_grad)
    loss(reference, batch(0)).backward()
    loss(net, rows_of(batch(0), dist.get_rank())).backward()
    assert all(p.main_grad is b for p, b in zip(net.parameters(), buffers))
    assert_main_grads(net, reference, dist.get_world_size())
    net.zero_grad(set_to_none=False)
    reference.zero_grad()
    loss(reference, batch(1)).backward()
    loss(net, rows_of(batch(1), dist.get_rank())).backward()
    assert all(p.main_grad is b for p, b in zip(net.parameters(), buffers))
    assert_main_grads(net, reference, dist.get_world_size())


def test_clipping_clips_main_grad():
    """torch.nn.utils.clip_grad_norm_ (and hyper_parallel's) read main_grad where .grad is left
    undefined: the reference's norm, and its clipped gradients."""
    reference, net = Net(), shard(Net())
    loss(reference, batch(0)).backward()
    loss(net, rows_of(batch(0), dist.get_rank())).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)  # torch's own: no layouts
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
    assert norm > 0.05
    torch.testing.assert_close(norm.to(expected.dtype), expected, rtol=1e-5, atol=0)
    assert_main_grads(net, reference, dist.get_world_size())


def test_unsynced_micro_batches_reach_main_grad_at_the_synced_one():
    reference, net = Net(), shard(Net())
    x = batch(0)
    loss(reference, x).backward()
    mine = rows_of(x, dist.get_rank())
    for m, micro in enumerate(mine.split(2)):
        net.set_requires_gradient_sync(m == 1)
        loss(net, micro).backward()
        if m == 0:
            assert all(getattr(p, "main_grad", None) is None for p in net.parameters())
    assert_main_grads(net, reference, dist.get_world_size())


def test_hsdp_main_grad():
    if dist.get_world_size() != 4:
        pytest.skip("a 2 x 2 (replicate, shard) mesh needs 4 ranks")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    reference, net = Net(), shard(Net(), mesh=mesh)
    loss(reference, batch(0)).backward()
    loss(net, rows_of(batch(0), dist.get_rank())).backward()
    assert_main_grads(net, reference, 2)


def test_bf16_shards_keep_the_fp32_reduction():
    """Each rank's gradient is computed in bf16; main_grad is their fp32 average, finer than bf16
    (what a .grad of the shards' dtype would round away)."""
    ws = dist.get_world_size()
    reference, net = Net().bfloat16(), shard(Net().bfloat16(), reduce_dtype=torch.float32)
    expected = [torch.zeros(p.shape) for p in reference.parameters()]
    for rank in range(ws):
        reference.zero_grad()
        (reference(rows_of(batch(0, torch.bfloat16), rank)).float().pow(2).sum() / ROWS_PER_RANK).backward()
        for e, q in zip(expected, reference.parameters()):
            e += q.grad.float() / ws
    loss(net, rows_of(batch(0, torch.bfloat16), dist.get_rank())).backward()
    finer = False
    for (name, p), e in zip(net.named_parameters(), expected):
        assert p.dtype == torch.bfloat16 and p.grad is None and p.main_grad.dtype == torch.float32, name
        torch.testing.assert_close(p.main_grad, piece(e, ws), rtol=1e-5, atol=1e-6, msg=name)
        finer = finer or not torch.equal(p.main_grad, p.main_grad.bfloat16().float())
    assert finer or ws == 1


def test_errors():
    with pytest.raises(ValueError, match="apply_grad_on_fp32_main_grad"):
        fully_shard(Net(), mp_policy=MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=1))
    hooked = shard(Net())
    hooked.head.weight.register_hook(lambda g: g * 2)
    with pytest.raises(NotImplementedError, match="expected no gradient hooks on head.weight"):
        hooked(rows_of(batch(0), dist.get_rank()))
    net = shard(Net())
    net.head.bias.main_grad = torch.zeros(7)
    with pytest.raises(ValueError, match="expected the main_grad of head.bias of this rank's shard shape"):
        loss(net, rows_of(batch(0), dist.get_rank())).backward()
    net.zero_grad()
    net.head.bias.main_grad = "not a tensor"
    with pytest.raises(TypeError, match="expected a parameter's main_grad None or a tensor, got <class 'str'>"):
        loss(net, rows_of(batch(0), dist.get_rank())).backward()
    net.zero_grad()
    reference = Net()
    loss(reference, batch(1)).backward()
    loss(net, rows_of(batch(1), dist.get_rank())).backward()  # the group trains on after them
    assert_main_grads(net, reference, dist.get_world_size())
