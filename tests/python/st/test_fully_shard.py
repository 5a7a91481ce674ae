"""fully_shard on torch.nn modules at 2 and 4 ranks, against the full-batch single-process
reference: training with reshard_after_forward on and off (bitwise run to run), HSDP (also with
the all-reduce held for the last micro-batch), gradient accumulation without sync (with a hooked
parameter, and a group, that only the unsynced micro-batches reach), tensor parallelism on a
2 x 2 mesh; implicit prefetch and unshard(async_op); an embedding's row-sparse gradient
reduce-scatter; comm_fusion's one message against buckets; the module's new methods; every
option that cannot apply is a clear error; the original's import paths; torch.utils.checkpoint
(both variants, around whole modules and parts of them) against the same run without it; a layer
no rank reaches keeps .grad None, as in one process; a loss term on the parameters themselves
adds to their reduced gradients; torch's clip_grad_norm_ takes the global norm."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint
from torch import nn

import hyper_parallel
from hyper_parallel import (ColwiseParallel, CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, RowwiseParallel,
                            full_tensor, fully_shard, init_device_mesh, parallelize_module)
from hyper_parallel.core import comm
from hyper_parallel.core.dtensor.dtensor import distribute_tensor
from hyper_parallel.core.dtensor.placement_types import Shard

from fully_shard_models import DIM, Block

ROWS_PER_RANK = 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def batch(step, ranks):
    torch.manual_seed(100 + step)
    return torch.randn(ranks * ROWS_PER_RANK, DIM)


def shard(net, **options):
    for b in net.blocks:
        fully_shard(b, **options)
    return fully_shard(net, **options)


def train(net, steps, sharded, replicas=None, replica=None):
    ws, r = dist.get_world_size(), dist.get_rank()
    replicas = ws if replicas is None else replicas
    replica = r if replica is None else replica
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    losses = []
    for s in range(steps):
        x = batch(s, replicas)
        if sharded:
            x = x[replica * ROWS_PER_RANK:][:ROWS_PER_RANK]
        opt.zero_grad()
        loss = net(x).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def dp_mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))


def test_trains_like_the_full_batch_reference_bitwise_run_to_run():
    reference = Net()
    ref_losses = train(reference, 3, sharded=False)
    for reshard in (True, False):
        runs = []
        for _ in range(2):
            net = shard(Net(), mesh=dp_mesh(), reshard_after_forward=reshard)
            assert isinstance(net, FSDPModule) and isinstance(net.blocks[0], hyper_parallel.HSDPModule)
            losses = train(net, 3, sharded=True)
            runs.append(torch.stack([comm.all_reduce(loss.reshape(1), comm.ReduceOp.AVG, comm.world())
                                     for loss in losses]))
            for p, q in zip(net.parameters(), reference.parameters()):
                torch.testing.assert_close(full_tensor(p), q.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(runs[0].flatten(), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
        assert torch.equal(runs[0], runs[1])


def test_each_rank_keeps_a_dim0_piece_and_the_optimizer_state_is_sharded():
    ws, r = dist.get_world_size(), dist.get_rank()
    full = Net()
    net = shard(Net(), mesh=dp_mesh())
    for p, q in zip(net.parameters(), full.parameters()):
        pieces = torch.chunk(q.detach(), ws, 0)  # torch.chunk: the last ranks' pieces may be empty
        assert torch.equal(p.detach(), pieces[r] if r < len(pieces) else q.detach()[:0])
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    net(batch(0, 1)).pow(2).mean().backward()
    opt.step()
    for p in net.parameters():
        assert p.grad.shape == p.shape and opt.state[p]["exp_avg"].shape == p.shape


def test_hsdp_on_a_replicate_by_shard_mesh():
    if dist.get_world_size() != 4:
        pytest.skip("a 2 x 2 (replicate, shard) mesh needs 4 ranks")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    reference, net = Net(), shard(Net(), mesh=mesh)
    train(reference, 2, sharded=False)
    comm.reset_collective_counts()
    train(net, 2, sharded=True)
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p), q.detach(), rtol=1e-5, atol=1e-6)
    assert comm.collective_count("reduce_scatter") == comm.collective_count("all_reduce") == 2 * 3


def test_gradient_accumulation_without_sync():
    ws, r = dist.get_world_size(), dist.get_rank()
    reference, net = Net(), fully_shard(Net(), mesh=dp_mesh())
    for m in range(3):
        reference(batch(m, ws)).pow(2).mean().backward()
        net.set_requires_gradient_sync(m == 2)
        comm.reset_collective_counts()
        net(batch(m, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK]).pow(2).mean().backward()
        assert comm.collective_count("reduce_scatter") == (1 if m == 2 else 0)
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p, p.grad), q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("keep", [True, False])
def test_reshard_after_backward_false_gathers_once_for_the_micro_batches(keep):
    """As FSDP2's: with neither resharding, three micro-batches gather each of the 3 groups once
    (9 gathers with it on); the next forward after an optimizer step gathers the changed shards."""
    ws, r = dist.get_world_size(), dist.get_rank()
    reference, net = Net(), shard(Net(), mesh=dp_mesh(), reshard_after_forward=False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, net)]
    for step in range(2):
        comm.reset_collective_counts()
        for m in range(3):
            net.set_requires_gradient_sync(m == 2)
            net.set_reshard_after_backward(not keep or m == 2)
            reference(batch(3 * step + m, ws)).pow(2).mean().backward()
            net(batch(3 * step + m, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK]).pow(2).mean().backward()
        assert comm.collective_count("all_gather") == (3 if keep else 9)
        for p, q in zip(net.parameters(), reference.parameters()):
            torch.testing.assert_close(full_tensor(p, p.grad), q.grad, rtol=1e-5, atol=1e-6)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p), q.detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="set_reshard_after_backward"):
        net.set_reshard_after_backward(1)


def test_groups_kept_gathered_across_a_step_gather_again_prefetched():
    """set_reshard_after_backward(False) throughout: after an optimizer step the next forward
    gathers the changed shards, a block's prefetched as in any forward (from the second pass on);
    unshard() gathers them too."""
    ws, r = dist.get_world_size(), dist.get_rank()
    reference, net = Net(), shard(Net(), mesh=dp_mesh(), reshard_after_forward=False)
    net.set_reshard_after_backward(False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, net)]
    for step in range(2):
        reference(batch(step, ws)).pow(2).mean().backward()
        net(batch(step, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK]).pow(2).mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    if ws > 1:
        assert net.blocks[1]._fsdp_group.gather_stats == {"gathers": 2, "prefetched": 1, "regathered": 1}
    for b in net.blocks:
        b.unshard()
    with torch.no_grad():
        torch.testing.assert_close(net.blocks[1](net.blocks[0](batch(2, ws))),
                                   reference.blocks[1](reference.blocks[0](batch(2, ws))), rtol=1e-5, atol=1e-6)
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p), q.detach(), rtol=1e-5, atol=1e-6)


def test_tensor_parallel_inside_fully_shard_on_a_2x2_mesh():
    if dist.get_world_size() != 4:
        pytest.skip("a 2 x 2 (dp, tp) mesh needs 4 ranks")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    reference = Net()
    net = copy.deepcopy(reference)
    for b in net.blocks:
        parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    shard(net, mesh=mesh["dp"])
    ref_losses = train(reference, 2, sharded=False, replicas=2)
    losses = train(net, 2, sharded=True, replicas=2, replica=dp)
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p), q.detach(), rtol=1e-5, atol=1e-6)
    mean = torch.stack([comm.all_reduce(loss.reshape(1), comm.ReduceOp.AVG, mesh["dp"].get_group())
                        for loss in losses])
    torch.testing.assert_close(mean.flatten(), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)


def test_reduce_op_type_sum_adds_the_ranks_gradients_up_on_the_module_it_is_set_on():
    """The original's set_reduce_op_type("sum") (not recursive): the root's group sums over the
    ranks (the reference's gradient, ws times); the blocks keep the average."""
    ws, r = dist.get_world_size(), dist.get_rank()
    reference, net = Net(), shard(Net(), mesh=dp_mesh())
    net.set_reduce_op_type(" SUM")
    reference(batch(0, ws)).pow(2).mean().backward()
    net(batch(0, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK]).pow(2).mean().backward()
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        factor = 1 if name.startswith("blocks.") else ws
        torch.testing.assert_close(full_tensor(p, p.grad), q.grad * factor, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh_shape", [(0,), (2, 2)])
def test_gradient_divide_factor_divides_the_ranks_sum_on_the_module_it_is_set_on(mesh_shape):
    """FSDP2's set_gradient_divide_factor(f) (not recursive): the root's group sums over every dp
    rank, HSDP's replicas included, and divides by f; the blocks keep the average."""
    ws, r = dist.get_world_size(), dist.get_rank()
    if mesh_shape == (2, 2) and ws != 4:
        pytest.skip("a 2 x 2 (replicate, shard) mesh needs 4 ranks")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if mesh_shape == (2, 2) \
        else dp_mesh()
    reference, net = Net(), shard(Net(), mesh=mesh)
    net.set_gradient_divide_factor(3)
    reference(batch(0, ws)).pow(2).mean().backward()
    net(batch(0, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK]).pow(2).mean().backward()
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        factor = 1 if name.startswith("blocks.") else ws / 3
        torch.testing.assert_close(full_tensor(p, p.grad), q.grad * factor, rtol=1e-5, atol=1e-6, msg=name)
    net.blocks[0].set_reduce_scatter_divide_factor(ws)  # the deprecated name; ws: the average again
    net.set_force_sum_reduction_for_comms(True)
    no_group = nn.Sequential(nn.Linear(2, 2))
    fully_shard(no_group[0], mesh=mesh)
    no_group = fully_shard(no_group, mesh=mesh)  # its Linear's call took every parameter: no group
    for bad in (0, -1.0, float("inf"), True, "2"):
        for module in (net, no_group):
            with pytest.raises(ValueError, match="set_gradient_divide_factor: expected a finite number > 0"):
                module.set_gradient_divide_factor(bad)


def doubled(net):
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(2).add_(0.5)
    return net


@pytest.mark.parametrize("mesh_shape", [(0,), (2, 2)])
def test_load_state_dict_takes_pieces_whole_tensors_or_dtensors_as_the_original(mesh_shape):
    """The original's HSDPModule.load_state_dict: a sharded parameter's value may be this rank's
    piece, the whole tensor or a DTensor; a module kept gathered after its forward reads the
    loaded values next. On a 2 x 2 (dp, tp) mesh the pieces nest in the tensor-parallel ones."""
    ws = dist.get_world_size()
    if mesh_shape == (2, 2) and ws != 4:
        pytest.skip("a 2 x 2 (dp, tp) mesh needs 4 ranks")
    source = doubled(Net())  # other values than Net()'s

    def sharded():
        net = Net()
        if mesh_shape == (2, 2):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            for b in net.blocks:
                parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            return shard(net, mesh=mesh["dp"], reshard_after_forward=False)
        return shard(net, mesh=dp_mesh(), reshard_after_forward=False)

    x = batch(0, 1)
    pieces = doubled(sharded()).state_dict()
    dtensors = {}
    for name, p in sharded().named_parameters():
        layout = hyper_parallel.layout_of(p)
        dtensors[name] = distribute_tensor(source.state_dict()[name], layout.mesh, layout.placements)
    for values in (source.state_dict(), pieces, dtensors):
        net = sharded()
        net(x)  # gathered, and kept
        assert not net.load_state_dict(values).missing_keys
        torch.testing.assert_close(net(x), source(x), rtol=1e-5, atol=1e-6)
        for p, q in zip(net.parameters(), source.parameters()):
            assert torch.equal(full_tensor(p), q.detach())
    wrong = dict(source.state_dict(), **{"head.weight": torch.zeros(3, DIM)})
    with pytest.raises(ValueError, match=r"expected head.weight of this rank's piece's shape \[.*\] or the "
                                         r"whole tensor's \[2, 12\], got \[3, 12\]"):
        sharded().load_state_dict(wrong)
    with pytest.raises(RuntimeError, match="Missing key"):
        sharded().load_state_dict({"head.weight": source.head.weight})
    with pytest.raises(ValueError, match="expected blocks.0.up.weight on a device, got it on meta"):
        shard(Net().to("meta"), mesh=dp_mesh()).load_state_dict(source.state_dict())
    # Through a module above it, which fully_shard was not applied to.
    holder = nn.ModuleDict({"net": sharded()})
    holder.load_state_dict({"net." + k: v for k, v in source.state_dict().items()})
    assert all(torch.equal(full_tensor(p), q.detach()) for p, q in zip(holder.net.parameters(), source.parameters()))
    # Between a forward and its backward, as torch: the backward would read other values.
    net = sharded()
    out = net(x).sum()
    net.load_state_dict(source.state_dict())
    with pytest.raises(ValueError, match="unchanged from a forward to its backward, got .* changed in place"):
        out.backward()


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.emb, self.head = nn.Embedding(10, DIM), nn.Linear(DIM, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


def test_load_state_dict_loads_a_tied_parameter_under_either_name():
    source = doubled(Tied())
    net = fully_shard(Tied(), mesh=dp_mesh())
    net.load_state_dict(source.state_dict())
    assert torch.equal(full_tensor(net.emb.weight), source.emb.weight.detach())
    ids = torch.arange(6).reshape(2, 3)
    torch.testing.assert_close(net(ids), source(ids), rtol=1e-5, atol=1e-6)


def test_mixed_precision_gathers_in_bf16_and_keeps_float32_shards():
    ws = dist.get_world_size()
    net = shard(Net(), mesh=dp_mesh(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                      reduce_dtype=torch.float32))
    train(net, 1, sharded=True)
    for p in net.parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
    assert ws >= 2


def test_mixed_precision_casts_the_modules_float_inputs_nested_and_by_keyword():
    seen = {}

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(DIM, DIM)

        def forward(self, x, extra=(), *, bias=None):
            seen.update(x=x.dtype, extra=[e.dtype for e in extra], bias=bias.dtype)
            return self.lin(x) + bias

    net = fully_shard(Probe(), mesh=dp_mesh(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    x = torch.randn(2, DIM)
    assert net(x, [x, torch.ones(2, dtype=torch.long)], bias=x).dtype == torch.bfloat16
    assert seen == {"x": torch.bfloat16, "extra": [torch.bfloat16, torch.int64], "bias": torch.bfloat16}


def test_mixed_precision_output_dtype_casts_each_sharded_modules_outputs():
    """FSDP2's output_dtype: each module fully_shard was applied to returns its floating outputs
    in it, after its pre-backward node (also a module whose parameters calls below took). bf16
    blocks with float32 outputs train bitwise as without, the loss taken of the output in float32."""
    def run(output_dtype):
        net, seen = Net(), []
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=output_dtype)
        shard(net, mesh=dp_mesh(), mp_policy=policy)
        net.blocks[0].register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        for s in range(2):
            out = net(batch(s, dist.get_world_size())[dist.get_rank() * ROWS_PER_RANK:][:ROWS_PER_RANK])
            seen.append(out.dtype)
            opt.zero_grad()
            out.float().pow(2).mean().backward()
            opt.step()
        return seen, [full_tensor(p) for p in net.parameters()]

    seen, cast = run(torch.float32)
    seen_before, before = run(None)
    assert seen == [torch.float32] * 4 and seen_before == [torch.bfloat16] * 4
    assert all(torch.equal(p, q) for p, q in zip(cast, before))

    class Wrapper(nn.Module):  # fully_shard on it takes no parameter: the block's call did
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return self.block(x).to(torch.bfloat16)

    wrapper = Wrapper()
    fully_shard(wrapper.block, mesh=dp_mesh())
    fully_shard(wrapper, mesh=dp_mesh(), mp_policy=MixedPrecisionPolicy(output_dtype=torch.float64))
    assert wrapper._fsdp_group is None and wrapper(batch(0, 1)).dtype == torch.float64


def test_an_int_reshard_after_forward_is_fsdp2s():
    """1: the gathered parameters stay (False); the shard group's size: they are freed (True)."""
    ws, r = dist.get_world_size(), dist.get_rank()

    def gathers(value):
        net = shard(Net(), mesh=dp_mesh(), reshard_after_forward=value)
        comm.reset_collective_counts()
        net(batch(0, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK]).pow(2).mean().backward()
        return comm.collective_count("all_gather")

    assert gathers(1) == gathers(False)
    assert gathers(ws) == gathers(ws > 1)
    if ws > 1:
        assert gathers(True) > gathers(False)
    if ws == 4:
        with pytest.raises(NotImplementedError, match=r"expected 1 \(False\), 4 \(True\) or a bool, got 2"):
            fully_shard(Net(), mesh=dp_mesh(), reshard_after_forward=2)
    with pytest.raises(ValueError, match="divides the shard group's size"):
        fully_shard(Net(), mesh=dp_mesh(), reshard_after_forward=ws + 1)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(reshard_after_forward=0), ValueError, "an int reshard_after_forward that divides"),
    (dict(reshard_after_forward="yes"), ValueError, "reshard_after_forward: expected a bool"),
    (dict(mp_policy=MixedPrecisionPolicy(output_dtype=torch.int64)), ValueError,
     "expected MixedPrecisionPolicy output_dtype None or a floating dtype, got torch.int64"),
    (dict(offload_policy=CPUOffloadPolicy()), ValueError, "pin_memory false"),
    (dict(replicate_params=[nn.Parameter(torch.zeros(2))]), NotImplementedError, "replicate_params"),
    (dict(shard_placement_fn=lambda p: Shard(1)), NotImplementedError, "only Shard\\(0\\)"),
    (dict(comm_fusion=1), ValueError, "comm_fusion: expected a bool"),
    (dict(row_sparse_embeddings=None), ValueError, "row_sparse_embeddings: expected a bool"),
    (dict(comm_fusion_zero_copy=1), ValueError, "comm_fusion_zero_copy: expected a bool"),
    (dict(sharded_accumulated_grad=True), NotImplementedError, "sharded_accumulated_grad=True is the original's"),
])
def test_options_that_cannot_apply_are_clear_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        fully_shard(Net(), mesh=dp_mesh(), **kwargs)


class Lm(nn.Module):
    VOCAB = 96

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.embed, self.block, self.head = nn.Embedding(self.VOCAB, DIM), Block(), nn.Linear(DIM, self.VOCAB)

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))


def train_lm(row_sparse_embeddings):
    """3 AdamW steps; each rank's 10 tokens touch at most 10 of the 96 embedding rows."""
    lm = Lm()
    for m in (lm.embed, lm.block, lm):
        fully_shard(m, mesh=dp_mesh(), row_sparse_embeddings=row_sparse_embeddings)
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-2)
    losses, forward_sent, sent = [], 0, 0
    for s in range(3):
        torch.manual_seed(200 + 16 * s + dist.get_rank())
        ids = torch.randint(0, 8, (2, 5)) * 11 % Lm.VOCAB + dist.get_rank()
        opt.zero_grad()
        before = comm.payload_bytes_sent()
        loss = lm(ids).pow(2).mean()
        forward_sent += comm.payload_bytes_sent() - before
        loss.backward()
        sent += comm.payload_bytes_sent() - before
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), [full_tensor(p) for p in lm.parameters()], forward_sent, sent - forward_sent


def test_an_embedding_alone_gathers_and_reduces_row_sparse_bitwise_as_dense():
    ws = dist.get_world_size()
    dense_losses, dense_params, dense_forward_sent, dense_sent = train_lm(row_sparse_embeddings=False)
    losses, params, forward_sent, sent = train_lm(row_sparse_embeddings=True)
    assert torch.equal(losses, dense_losses)
    assert all(torch.equal(p, q) for p, q in zip(params, dense_params))
    # Per step: the dense reduce-scatter sends ws - 1 blocks of ceil(96 / ws) rows of DIM fp32;
    # the sparse one ws counts to each peer and at most 10 rows, each with its index.
    row_bytes, block_rows = DIM * 4, -(-Lm.VOCAB // ws)
    saved = (ws - 1) * block_rows * row_bytes - ((ws - 1) * 8 * ws + 10 * (8 + row_bytes))
    assert sent <= dense_sent - 3 * saved
    # The forward gathers the rows of this rank's 10 tokens, not the embedding's 96.
    gather_saved = (ws - 1) * block_rows * row_bytes - ((ws - 1) * 8 + 10 * 8 + (ws - 1) * 10 * row_bytes)
    assert forward_sent <= dense_forward_sent - 3 * gather_saved


def train_wide(comm_fusion, **options):
    """2 AdamW steps of a block of two 1024 x 1024 fp32 layers (4 MiB of gradient each); the
    reduce-scatters of each backward."""
    torch.manual_seed(5)
    block = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    fully_shard(block, mesh=dp_mesh(), comm_fusion=comm_fusion, **options)
    opt = torch.optim.AdamW(block.parameters(), lr=1e-2)
    counts = []
    for s in range(2):
        torch.manual_seed(300 + s + dist.get_rank())
        opt.zero_grad()
        loss = block(torch.randn(4, 1024)).pow(2).mean()
        comm.reset_collective_counts()
        loss.backward()
        counts.append(comm.collective_count("reduce_scatter"))
        opt.step()
    return counts, [full_tensor(p) for p in block.parameters()]


def test_comm_fusion_reduces_a_group_in_one_message_and_buckets_otherwise_bitwise():
    fused_counts, fused = train_wide(comm_fusion=True)
    counts, params = train_wide(comm_fusion=False)
    assert fused_counts == [1, 1]
    # The second layer's weight fills a bucket; its bias, the first layer's weight and bias the last.
    assert counts == [2, 2]
    assert all(torch.equal(p, q) for p, q in zip(params, fused))
    # The original's comm_fusion_zero_copy is accepted and changes nothing.
    zero_copy_counts, zero_copy = train_wide(comm_fusion=True, comm_fusion_zero_copy=True)
    assert zero_copy_counts == [1, 1] and all(torch.equal(p, q) for p, q in zip(zero_copy, fused))


class WithSpare(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.layer, self.spare = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x, use_spare):
        x = self.layer(x)
        return self.spare(x) if use_spare else x


def test_hooks_of_a_parameter_used_only_without_sync_see_its_reduced_gradient():
    """The synced backward does not reach spare: its Python hook still runs once, on the reduced
    sum of the unsynced micro-batches, in buckets as in one message."""
    ws, r = dist.get_world_size(), dist.get_rank()
    grads, calls = {}, []

    def double(g):
        calls.append(1)
        return g * 2

    for comm_fusion in (True, False):
        for hooked in (False, True):
            net = fully_shard(WithSpare(), mesh=dp_mesh(), comm_fusion=comm_fusion)
            if hooked:
                net.spare.weight.register_hook(double)
            net(batch(0, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK], True).sum().backward()  # every gradient
            net.zero_grad(set_to_none=True)
            calls.clear()
            for m in range(3):
                net.set_requires_gradient_sync(m == 2)
                net(batch(1 + m, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK], m < 2).pow(2).mean().backward()
            assert len(calls) == (1 if hooked else 0)
            grads[comm_fusion, hooked] = [full_tensor(p, p.grad) for p in net.parameters()]
    for comm_fusion in (True, False):
        plain, hooked = grads[comm_fusion, False], grads[comm_fusion, True]
        assert torch.equal(hooked[2], plain[2] * 2)  # spare.weight
        assert all(torch.equal(a, b) for i, (a, b) in enumerate(zip(hooked, plain)) if i != 2)
    assert all(torch.equal(a, b) for a, b in zip(grads[True, True], grads[False, True]))


def test_sums_of_a_group_the_synced_backward_does_not_reach_are_reduced_with_it():
    """spare, a group of its own, runs only in the unsynced micro-batches: its sums are
    reduce-scattered at the end of the synced backward, and the next step holds only its own."""
    ws, r = dist.get_world_size(), dist.get_rank()
    reference = WithSpare()
    net = copy.deepcopy(reference)
    fully_shard(net.spare, mesh=dp_mesh())
    fully_shard(net, mesh=dp_mesh())

    def expect_reference_gradients():
        for p, q in zip(net.parameters(), reference.parameters()):
            torch.testing.assert_close(full_tensor(p, p.grad), q.grad, rtol=1e-5, atol=1e-6)

    for m in range(3):
        reference(batch(m, ws), m < 2).pow(2).mean().backward()
        net.set_requires_gradient_sync(m == 2)
        net(batch(m, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK], m < 2).pow(2).mean().backward()
    expect_reference_gradients()
    reference.zero_grad(set_to_none=True)
    net.zero_grad(set_to_none=True)
    reference(batch(3, ws), True).pow(2).mean().backward()
    net(batch(3, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK], True).pow(2).mean().backward()
    expect_reference_gradients()


@pytest.mark.parametrize("comm_fusion", [False, True])
def test_hsdp_without_all_reduce_holds_the_reduce_scatters_for_the_last_micro_batch(comm_fusion):
    """set_requires_all_reduce(False) on a 2 x 2 (replicate, shard) mesh: micro-batches 0 and 1
    reduce-scatter into held sums and leave .grad as it was; the last one all-reduces them with
    its own, once. spare, a group of its own, runs only in the held micro-batches: its sums are
    all-reduced at the end of the last backward. A hook on layer.weight sees the whole gradient."""
    ws, r = dist.get_world_size(), dist.get_rank()
    if ws != 4:
        pytest.skip("a 2 x 2 (replicate, shard) mesh needs 4 ranks")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    reference = WithSpare()
    net = copy.deepcopy(reference)
    fully_shard(net.spare, mesh=mesh, comm_fusion=comm_fusion)
    fully_shard(net, mesh=mesh, comm_fusion=comm_fusion)
    seen = []
    net.layer.weight.register_hook(lambda g: seen.append(g.clone()))
    for m in range(3):
        reference(batch(m, ws), m < 2).pow(2).mean().backward()
        net.set_requires_all_reduce(m == 2)
        net.set_is_last_backward(m == 2)  # the original's loop; changes nothing here
        comm.reset_collective_counts()
        net(batch(m, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK], m < 2).pow(2).mean().backward()
        assert comm.collective_count("reduce_scatter") == 2
        assert comm.collective_count("all_reduce") == (2 if m == 2 else 0)
        if m < 2:
            assert all(p.grad is None for p in net.parameters()) and not seen
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p, p.grad), q.grad, rtol=1e-5, atol=1e-6)
    assert len(seen) == 1 and torch.equal(seen[0], net.layer.weight.grad)


class FailsOnce(Net):
    """Net whose backward raises once between its blocks when fail is set."""

    fail = False

    def forward(self, x):
        x = self.blocks[0](x)
        if self.fail:
            self.fail = False

            def boom(grad):
                raise ArithmeticError("boom")

            x.register_hook(boom)
        return self.head(self.norm(self.blocks[1](x)))


@pytest.mark.parametrize("comm_fusion", [False, True])
@pytest.mark.parametrize("held, fails", [("all-reduce", 1), ("all-reduce", 2), ("sync", 0), ("sync", 1),
                                         ("sync", 2)])
def test_a_failed_backward_leaves_the_held_sums_as_they_were_for_its_retry(comm_fusion, held, fails):
    """Micro-batches 0 and 1 hold sums (reduce-scattered without the all-reduce, or kept without
    sync), 2 reduces them; micro-batch `fails` raises part-way once and is run again: the
    gradients are the reference's, neither one micro-batch more nor the held ones fewer."""
    ws, r = dist.get_world_size(), dist.get_rank()
    if ws != 4:
        pytest.skip("a 2 x 2 (replicate, shard) mesh needs 4 ranks")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    reference = Net()
    net = FailsOnce()
    shard(net, mesh=mesh, comm_fusion=comm_fusion)
    for m in range(3):
        reference(batch(m, ws)).pow(2).mean().backward()
        if held == "all-reduce":
            net.set_requires_all_reduce(m == 2)
        else:
            net.set_requires_gradient_sync(m == 2)
        x = batch(m, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK]
        if m == fails:
            net.fail = True
            with pytest.raises(ArithmeticError, match="boom"):
                net(x).pow(2).mean().backward()
        net(x).pow(2).mean().backward()
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p, p.grad), q.grad, rtol=1e-5, atol=1e-6, msg=name)


class Branchy(nn.Module):
    """g (a then b, or a alone) under a head; a rank's mode picks what it runs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.g, self.head = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)]), nn.Linear(DIM, DIM)

    def forward(self, x, mode):
        if mode != "head only":
            x = self.g[0](x)
            x = self.g[1](x) if mode == "a, b" else x
        return self.head(x)


@pytest.mark.parametrize("comm_fusion", [False, True])
def test_sums_held_for_parameters_some_ranks_reached_are_reduced_with_one_layout(comm_fusion):
    """An unsynced micro-batch reaches b on rank 0 only, the synced one reaches only the head:
    the group of a and b reduces its held sums in one message of the same layout on every rank
    (b's averaged with the others' zeros), as the average of the ranks' one-process gradients."""
    ws, r = dist.get_world_size(), dist.get_rank()
    modes = ["a, b" if q == 0 else "a" for q in range(ws)]
    reference = Branchy()
    net = copy.deepcopy(reference)
    # Kept gathered: a rank that skips b leaves the pass open (every rank must run the same
    # modules for the backward's gathers to match).
    options = dict(mesh=dp_mesh(), comm_fusion=comm_fusion, reshard_after_forward=False)
    fully_shard(net.g, **options)
    fully_shard(net, **options)
    for m, mode_of in enumerate((modes, ["head only"] * ws)):
        for q in range(ws):
            x = batch(m, ws)[q * ROWS_PER_RANK:][:ROWS_PER_RANK]
            (reference(x, mode_of[q]).pow(2).mean() / ws).backward()
        net.set_requires_gradient_sync(m == 1)
        net(batch(m, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK], mode_of[r]).pow(2).mean().backward()
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p, p.grad), q.grad, rtol=1e-5, atol=1e-6)


def accumulate_with_a_frozen_layer(comm_fusion):
    """Unsynced: rank 0 runs a and b, the others a; a is frozen for the synced micro-batch (the
    head only), then unfrozen for the next (a and b everywhere). The gradients after each."""
    ws, r = dist.get_world_size(), dist.get_rank()
    net = Branchy()
    options = dict(mesh=dp_mesh(), comm_fusion=comm_fusion, reshard_after_forward=False)
    fully_shard(net.g, **options)
    fully_shard(net, **options)
    grads = []
    for m, mode in enumerate(("a, b" if r == 0 else "a", "head only", "a, b")):
        for p in net.g[0].parameters():
            p.requires_grad_(m != 1)
        net.set_requires_gradient_sync(m > 0)
        net(batch(m, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK], mode).pow(2).mean().backward()
        if m > 0:
            grads.append([None if p.grad is None else full_tensor(p, p.grad) for p in net.parameters()])
    return grads


def test_a_parameter_frozen_between_micro_batches_keeps_its_sum_alike_in_either_mode():
    """Every rank that holds a sum sends the held sums' message (rank 1 holds only the frozen
    a's), and a frozen parameter keeps its sum until a synced backward after it is unfrozen, in
    one message as in buckets."""
    fused, buckets = accumulate_with_a_frozen_layer(True), accumulate_with_a_frozen_layer(False)
    for step_fused, step_buckets in zip(fused, buckets):
        for f, b in zip(step_fused, step_buckets):
            assert (f is None and b is None) or torch.equal(f, b)
    assert fused[0][0] is None and fused[0][2] is not None  # a frozen: no .grad yet; b's sum


@pytest.mark.parametrize("comm_fusion", [False, True])
def test_a_layer_every_rank_skips_keeps_no_gradient_and_adamw_leaves_it(comm_fusion):
    """spare shares its group with layer; steps 1 and 2 skip it on every rank: its .grad stays
    None, as in one process, so AdamW neither decays nor moves it."""
    ws, r = dist.get_world_size(), dist.get_rank()
    reference = WithSpare()
    net = fully_shard(copy.deepcopy(reference), mesh=dp_mesh(), comm_fusion=comm_fusion)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, net)]
    for s in range(3):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        reference(batch(s, ws), s == 0).pow(2).mean().backward()
        net(batch(s, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK], s == 0).pow(2).mean().backward()
        for p, q in zip(net.parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None)
        for opt in opts:
            opt.step()
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p), q.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("comm_fusion", [False, True])
@pytest.mark.parametrize("reshard", [True, False])
def test_a_loss_term_on_the_parameters_adds_to_their_reduced_gradients(reshard, comm_fusion):
    """An L2 penalty over net.parameters() (the shards) in the same loss, on all of them, the first
    only, or in reverse order: each shard's gradient is the reduced one of the data plus the
    penalty's, in whatever order the backward reaches them, as in one process."""
    ws, r = dist.get_world_size(), dist.get_rank()
    reference, net = Net(), shard(Net(), mesh=dp_mesh(), reshard_after_forward=reshard, comm_fusion=comm_fusion)
    for pick in (lambda ps: ps, lambda ps: ps[:1], lambda ps: ps[::-1]):
        for m in (reference, net):
            m.zero_grad()

        def penalty(m):
            return 0.1 * sum(p.pow(2).sum() for p in pick(list(m.parameters())))

        (reference(batch(0, ws)).pow(2).mean() + penalty(reference)).backward()
        (net(batch(0, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK]).pow(2).mean() + penalty(net)).backward()
        for (name, p), q in zip(net.named_parameters(), reference.parameters()):
            torch.testing.assert_close(full_tensor(p, p.grad), q.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")


def test_torch_clip_grad_norm_takes_the_norm_of_the_whole_parameters():
    ws, r = dist.get_world_size(), dist.get_rank()
    reference, net = Net(), shard(Net(), mesh=dp_mesh())
    reference(batch(0, ws)).pow(2).mean().backward()
    net(batch(0, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK]).pow(2).mean().backward()
    norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3) for m in (reference, net)]
    torch.testing.assert_close(norms[1].to(norms[0].dtype), norms[0], rtol=1e-5, atol=0)
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p, p.grad), q.grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("kind", [nn.Embedding, nn.EmbeddingBag])
def test_an_embedding_with_sparse_gradients_is_a_clear_error_before_anything_changes(kind):
    net = nn.Sequential(kind(10, DIM, sparse=True), nn.Linear(DIM, 2))
    with pytest.raises(NotImplementedError, match=rf"expected embeddings with dense gradients, got "
                                                  rf"{kind.__name__}\(sparse=True\) owning 0.weight"):
        fully_shard(net, mesh=dp_mesh())
    assert not isinstance(net, FSDPModule) and net[0].weight.shape == (10, DIM)


@pytest.mark.parametrize("kind", [nn.Embedding, nn.EmbeddingBag])
def test_a_trainable_embedding_with_max_norm_is_a_clear_error(kind):
    """Its forward renormalizes the looked-up rows of the gathered weight in place: the shards
    would never be; a frozen one is fine (every forward renormalizes the rows it reads again)."""
    net = nn.Sequential(kind(10, DIM, max_norm=1.0), nn.Linear(DIM, 2))
    with pytest.raises(NotImplementedError, match=rf"expected trainable embeddings without max_norm, got "
                                                  rf"{kind.__name__}\(max_norm=1.0\) owning 0.weight"):
        fully_shard(net, mesh=dp_mesh())
    assert not isinstance(net, FSDPModule)
    alone = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "alone"))["alone"]
    fully_shard(nn.Sequential(kind(10, DIM, max_norm=1.0)), mesh=alone)  # one rank: nothing to diverge from
    net[0].weight.requires_grad_(False)
    fully_shard(net, mesh=dp_mesh())


def test_module_zero_grad_without_set_to_none_zeroes_as_torch_does():
    """net.zero_grad(set_to_none=False) (torch 1.13's default for nn.Module) keeps each .grad as a
    zero tensor: a layer skipped in the next step still gets AdamW's decay and momentum, as in one
    process."""
    ws, r = dist.get_world_size(), dist.get_rank()
    reference = WithSpare()
    net = fully_shard(copy.deepcopy(reference), mesh=dp_mesh())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, net)]
    for s in range(3):
        grads = [p.grad for p in net.parameters()]
        for m in (reference, net):
            m.zero_grad(set_to_none=False)
        for p, q, before in zip(net.parameters(), reference.parameters(), grads):
            assert (p.grad is None) == (q.grad is None)
            if before is not None:
                assert p.grad is before and not p.grad.any()  # zeroed in place
        reference(batch(s, ws), s == 0).pow(2).mean().backward()
        net(batch(s, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK], s == 0).pow(2).mean().backward()
        for opt in opts:
            opt.step()
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p), q.detach(), rtol=1e-5, atol=1e-6)


class DictLinear(nn.Linear):
    """Owns its parameters and returns a dict."""

    def forward(self, x):
        return {"out": torch.tanh(super().forward(x))}


def test_a_module_returning_a_dict_is_gathered_again_for_its_backward():
    ws, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(12)
    reference = nn.ModuleDict({"a": DictLinear(DIM, DIM), "b": DictLinear(DIM, DIM)})
    net = copy.deepcopy(reference)
    for name in ("a", "b"):
        fully_shard(net[name], mesh=dp_mesh(), reshard_after_forward=True)
    x = batch(0, ws)
    net["b"](net["a"](x[r * ROWS_PER_RANK:][:ROWS_PER_RANK])["out"])["out"].pow(2).mean().backward()
    reference["b"](reference["a"](x)["out"])["out"].pow(2).mean().backward()
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p, p.grad), q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_reentrant_checkpoint_whose_input_needs_no_grad_leaves_its_parameters_without_gradients():
    """torch's reentrant checkpoint gives no gradient to a region none of whose inputs requires
    grad (the first block's up layer, on the raw input): its parameters keep .grad None, as in
    one process, while the rest of their group gets its gradients."""
    ws, r = dist.get_world_size(), dist.get_rank()
    reference = Checkpointed("up", use_reentrant=True)
    net = shard(copy.deepcopy(reference), mesh=dp_mesh())
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        reference(batch(0, ws)).pow(2).mean().backward()
        net(batch(0, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK]).pow(2).mean().backward()
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None) == name.startswith("blocks.0.up."), name


def test_module_methods_and_their_errors():
    net = shard(Net(), mesh=dp_mesh())
    with pytest.raises(ValueError, match="expected a module fully_shard was not applied to"):
        fully_shard(net)
    with pytest.raises(ValueError, match="expected an nn.Module"):
        fully_shard("not a module")
    with pytest.raises(ValueError, match="unshard async_op: expected a bool"):
        net.unshard(async_op=1)
    with pytest.raises(ValueError, match="expected a list of FSDPModule, got Linear"):
        net.set_modules_to_forward_prefetch([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="set_requires_all_reduce: expected a bool, got int"):
        net.set_requires_all_reduce(1)
    with pytest.raises(ValueError, match="set_is_last_backward: expected a bool, got NoneType"):
        net.set_is_last_backward(None)
    with pytest.raises(ValueError, match=r"set_reduce_op_type: expected one of \['avg', 'sum'\], got 'max'"):
        net.set_reduce_op_type("max")
    with pytest.raises(ValueError, match="set_gradient_scaling_factor: expected None, a number"):
        net.set_gradient_scaling_factor(True)
    handle = net.unshard(async_op=True)
    handle.wait()
    net.reshard()
    net.set_modules_to_forward_prefetch([net.blocks[1]])
    net.blocks[0].set_modules_to_backward_prefetch([net.blocks[1]])
    net.set_gradient_scaling_factor()  # the original's default: None, no scaling
    net.set_gradient_scaling_factor(0.5)
    train(net, 1, sharded=True)
    net.zero_grad()
    assert all(p.grad is None for p in net.parameters())


@pytest.mark.parametrize("reshard", [True, False])
def test_implicit_prefetch_gathers_the_next_module_ahead(reshard):
    """Forward order root (gathered for its whole forward), block0, block1; backward root,
    block1, block0: from the second step on, each block's forward gather is in flight before it
    runs, and each backward gather but the root's is started by the module whose backward came
    before."""
    if dist.get_world_size() == 1:
        pytest.skip("one rank gathers at once")
    steps, backward = 3, (3 if reshard else 0)
    net = shard(Net(), mesh=dp_mesh(), reshard_after_forward=reshard)
    train(net, steps, sharded=True)
    for module, prefetched in ((net.blocks[0], steps - 1 + backward), (net.blocks[1], steps - 1 + backward),
                               (net, 0)):
        stats = module._fsdp_group.gather_stats
        assert stats == {"gathers": steps * (2 if reshard else 1), "prefetched": prefetched, "regathered": 0}


def test_unshard_async_op_travels_until_waited_and_a_changed_shard_is_gathered_again():
    changed_first, changed_after = shard(Net(), mesh=dp_mesh()), shard(Net(), mesh=dp_mesh())
    with torch.no_grad():
        changed_first.blocks[0].up.weight.mul_(0.5)
        handle = changed_after.blocks[0].unshard(async_op=True)
        changed_after.blocks[0].up.weight.mul_(0.5)
        x = batch(0, dist.get_world_size())[dist.get_rank() * ROWS_PER_RANK:][:ROWS_PER_RANK]
        assert torch.equal(changed_after(x), changed_first(x))
    handle.wait()
    assert changed_after.blocks[0]._fsdp_group.gather_stats["regathered"] == 1
    block = changed_after.blocks[1]
    block.reshard()
    block.unshard(async_op=True).wait()
    assert block._fsdp_group.is_unsharded


def test_the_originals_import_paths():
    from hyper_parallel.core.fully_shard import HSDPModule, fully_shard as f  # noqa: F401
    from hyper_parallel.platform.torch.fully_shard.utils import MixedPrecisionPolicy as M, OffloadPolicy  # noqa: F401
    assert f is fully_shard and M is MixedPrecisionPolicy and HSDPModule is FSDPModule


class Checkpointed(Net):
    """Net whose blocks run under torch.utils.checkpoint: each whole block, only its up or down
    layer, or up and down in regions of their own (one group, two nested backwards when
    reentrant)."""

    def __init__(self, regions, use_reentrant):
        super().__init__()
        self.regions, self.use_reentrant = regions, use_reentrant

    def forward(self, x):
        def ckpt(fn, *args):
            return checkpoint(fn, *args, use_reentrant=self.use_reentrant) if self.regions else fn(*args)

        for b in self.blocks:
            if self.regions in (None, "block"):
                x = ckpt(b, x)
            else:
                h = torch.relu(ckpt(b.up, x) if "up" in self.regions else b.up(x))
                x = x + (ckpt(b.down, h) if "down" in self.regions else b.down(h))
        return self.head(self.norm(x))


def train_checkpointed(regions, use_reentrant, sharded, **options):
    """3 AdamW steps (the input requires grad: a reentrant checkpoint's gradients need it); the
    losses, the parameters and each step's gathers and reduce-scatters."""
    ws, r = dist.get_world_size(), dist.get_rank()
    net = Checkpointed(regions, use_reentrant)
    if sharded:
        shard(net, mesh=dp_mesh(), **options)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    losses, counts = [], []
    for s in range(3):
        x = batch(s, ws)
        x = (x[r * ROWS_PER_RANK:][:ROWS_PER_RANK] if sharded else x).requires_grad_()
        opt.zero_grad()
        comm.reset_collective_counts()
        loss = net(x).pow(2).mean()
        loss.backward()
        counts.append((comm.collective_count("all_gather"), comm.collective_count("reduce_scatter")))
        opt.step()
        losses.append(loss.detach())
    params = [full_tensor(p) for p in net.parameters()] if sharded else [p.detach() for p in net.parameters()]
    return losses, params, counts


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("regions", ["block", "up", "down", "up, down"])
def test_activation_checkpointing_trains_as_without_it_with_no_more_collectives(regions, use_reentrant):
    """The recomputation in the backward uses the gathered parameters (gathered again if they were
    resharded) and its gradients reach the group's one reduction: bitwise the run without
    checkpointing, with the same reduce-scatters and no more gathers, in buckets and in one
    message."""
    _, reference, _ = train_checkpointed(None, False, sharded=False)
    for reshard in (True, False):
        for comm_fusion in (False, True):
            options = dict(reshard_after_forward=reshard, comm_fusion=comm_fusion)
            _, plain, plain_counts = train_checkpointed(None, False, sharded=True, **options)
            _, params, counts = train_checkpointed(regions, use_reentrant, sharded=True, **options)
            for p, q in zip(params, reference):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            assert all(torch.equal(p, q) for p, q in zip(params, plain)), (reshard, comm_fusion)
            # A group that a reentrant checkpoint runs in part stays gathered to its backward.
            assert [rs for _, rs in counts] == [rs for _, rs in plain_counts], (reshard, comm_fusion)
            assert all(ag <= plain_ag for (ag, _), (plain_ag, _) in zip(counts, plain_counts))
            if not (use_reentrant and regions == "up"):
                assert counts == plain_counts, (reshard, comm_fusion)


def accumulate_checkpointed(regions, use_reentrant, mesh, comm_fusion):
    """3 micro-batches, the last synced, with a hooked parameter in each block; the gradients and
    the reduce-scatters and all-reduces."""
    ws, r = dist.get_world_size(), dist.get_rank()
    net = Checkpointed(regions, use_reentrant)
    shard(net, mesh=mesh, comm_fusion=comm_fusion)
    net.blocks[0].up.weight.register_hook(lambda g: g * 2)
    net.blocks[1].down.bias.register_hook(lambda g: g * 3)
    comm.reset_collective_counts()
    for m in range(3):
        net.set_requires_gradient_sync(m == 2)
        net(batch(m, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK].requires_grad_()).pow(2).mean().backward()
    counts = (comm.collective_count("reduce_scatter"), comm.collective_count("all_reduce"))
    return [full_tensor(p, p.grad) for p in net.parameters()], counts


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_with_accumulation_hooks_and_hsdp(use_reentrant):
    """Held sums, hooked parameters (their bucket ends with them) and HSDP's all-reduces under
    checkpointing: bitwise the gradients without it, with the same reductions."""
    ws = dist.get_world_size()
    meshes = [dp_mesh()]
    if ws == 4:
        meshes.append(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    for mesh in meshes:
        plain, plain_counts = accumulate_checkpointed(None, False, mesh, comm_fusion=False)
        for regions in ("block", "up", "down", "up, down"):
            grads, counts = accumulate_checkpointed(regions, use_reentrant, mesh, comm_fusion=False)
            assert all(torch.equal(a, b) for a, b in zip(grads, plain)), regions
            assert counts == plain_counts, regions
        # Without a cap a reentrant checkpoint's group reduces in buckets: a hooked parameter
        # ends its own.
        fused, _ = accumulate_checkpointed(None, False, mesh, comm_fusion=True)
        grads, _ = accumulate_checkpointed("up, down", use_reentrant, mesh, comm_fusion=True)
        assert all(torch.equal(a, b) for a, b in zip(grads, fused))


def train_with_an_extra_forward(regions, use_reentrant, comm_fusion, where):
    """3 AdamW steps with a forward without grad (an evaluation, or logging) either between the
    forward and its backward, or inside the backward (a hook on the input's gradient); the
    parameters, the collectives of each step and whether each group is left gathered."""
    ws, r = dist.get_world_size(), dist.get_rank()
    net = shard(Checkpointed(regions, use_reentrant), mesh=dp_mesh(), comm_fusion=comm_fusion)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    counts = []
    for s in range(3):
        x = batch(s, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK].requires_grad_()
        opt.zero_grad()
        comm.reset_collective_counts()
        loss = net(x).pow(2).mean()
        if where == "between":
            with torch.no_grad():
                net(x)
        else:
            x.register_hook(lambda g: (torch.no_grad()(net)(x), g)[1])
        loss.backward()
        counts.append((comm.collective_count("all_gather"), comm.collective_count("reduce_scatter")))
        opt.step()
    gathered = [m._fsdp_group.is_unsharded for m in (net, *net.blocks)]
    return [full_tensor(p) for p in net.parameters()], counts, gathered


@pytest.mark.parametrize("where", ["between", "in a hook"])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_forward_without_grad_beside_checkpointing_leaves_training_as_it_is(use_reentrant, where):
    """The backward recomputes the pass it belongs to, not the evaluation after it; a forward
    without grad inside the backward is not a recomputation: it reshards what it gathered."""
    for comm_fusion in (False, True):
        plain = train_with_an_extra_forward(None, False, comm_fusion, where)
        for regions in ("block", "up", "down"):
            params, counts, gathered = train_with_an_extra_forward(regions, use_reentrant, comm_fusion, where)
            assert all(torch.equal(p, q) for p, q in zip(params, plain[0])), (regions, comm_fusion)
            assert [rs for _, rs in counts] == [rs for _, rs in plain[1]], (regions, comm_fusion)
            if where == "in a hook":
                # The hook's forward gathers a group whose backward ended before it (as here, in
                # a nested backward), and reshards it; one whose backward is under way is used.
                assert all(ag <= plain_ag + 3 for (ag, _), (plain_ag, _) in zip(counts, plain[1]))
            elif not (use_reentrant and regions == "up"):
                assert counts == plain[1], (regions, comm_fusion)
            assert gathered == plain[2] == [False] * 3, (regions, comm_fusion)


class ReentrantLayer(WithSpare):
    def forward(self, x, use_spare):
        x = checkpoint(self.layer, x, use_reentrant=True)
        return self.spare(x) if use_spare else x


def test_a_hooked_bucket_waiting_for_a_reentrant_region_is_an_error_that_says_so():
    """layer.weight (hooked) shares its planned bucket with spare, which a step skips: under a
    reentrant checkpoint its bucket cannot start when its gradient arrives (spare might still
    come through the nested backward); every rank raises, naming the way out."""
    ws, r = dist.get_world_size(), dist.get_rank()
    net = fully_shard(ReentrantLayer(), mesh=dp_mesh())
    net.layer.weight.register_hook(lambda g: g * 2)
    x = batch(0, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK].requires_grad_()
    net(x, True).pow(2).mean().backward()
    with pytest.raises(RuntimeError, match="a reentrant checkpoint's region.*use_reentrant=False"):
        net(x, False).pow(2).mean().backward()


@pytest.mark.parametrize("comm_fusion", [False, True], ids=["buckets", "one_reduce_scatter"])
def test_autograd_grad_of_managed_parameters_is_a_clear_error_that_adds_nothing(comm_fusion):
    """torch.autograd.grad(loss, params) would have the reduction add the gradients to .grad, or
    to the sums kept without sync, and return none: a NotImplementedError before anything is
    added. backward(inputs=) naming some of a group's parameters: in buckets, theirs alone are
    reduced (as torch accumulates them alone); one reduce-scatter for the group would reduce
    them all, so it refuses. Of the inputs, autograd.grad is torch's."""
    ws, r = dist.get_world_size(), dist.get_rank()
    reference, net = Net(), fully_shard(Net(), mesh=dp_mesh(), comm_fusion=comm_fusion)
    x = batch(0, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK]
    for sync in (True, False):
        net.set_requires_gradient_sync(sync)
        with pytest.raises(NotImplementedError, match=r"expected a backward that accumulates the gradients of the "
                                                      r"group's parameters, got one that returns the gradient of "):
            torch.autograd.grad(net(x).pow(2).mean(), list(net.parameters()))
        assert all(p.grad is None for p in net.parameters())
    net.set_requires_gradient_sync(True)
    first = next(net.parameters())
    reference(batch(0, ws)).pow(2).mean().backward()
    if comm_fusion:
        with pytest.raises(NotImplementedError, match=r"got one that leaves out .* \(inputs=\): a group that reduces "
                                                      r"in one reduce-scatter \(comm_fusion=True\)"):
            torch.autograd.backward(net(x).pow(2).mean(), inputs=[first])
        assert all(p.grad is None for p in net.parameters())
    else:
        torch.autograd.backward(net(x).pow(2).mean(), inputs=[first])
        torch.testing.assert_close(full_tensor(first, first.grad), next(reference.parameters()).grad, rtol=1e-5,
                                   atol=1e-6)
        assert all(p.grad is None for p in list(net.parameters())[1:])
        net.zero_grad()
    xs = x.clone().requires_grad_()
    (got,) = torch.autograd.grad(net(xs).pow(2).mean(), xs)  # of an input: no reduction runs
    xr = batch(0, ws).requires_grad_()
    (expected,) = torch.autograd.grad(reference(xr).pow(2).mean() * ws, xr)
    torch.testing.assert_close(got, expected[r * ROWS_PER_RANK:][:ROWS_PER_RANK], rtol=1e-5, atol=1e-6)
    net(x).pow(2).mean().backward()  # nothing was kept from the refused ones
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p, p.grad), q.grad, rtol=1e-5, atol=1e-6)
