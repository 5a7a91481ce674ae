"""torch's conversions after fully_shard, as FSDP2 allows. A module cast (module.to(dtype),
.double(), .bfloat16()): the groups gather in the shards' new dtype and train like the reference
cast the same way, with reshard_after_forward on and off and beside a MixedPrecisionPolicy; a cast
between a forward and its backward, or of part of a group, and a parameter's .data replaced by a
tensor of another size are clear errors; .data replaced while a gather is in flight is gathered
again. Deferred initialization: fully_shard on meta parameters (or a model built under
init_empty_weights), then to_empty and an initialization, trains like the reference (a group made
partly on meta, a tied weight, tensor parallelism on a 2 x 2 mesh); a forward before to_empty is a
clear error."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from hyper_parallel import (ColwiseParallel, MixedPrecisionPolicy, RowwiseParallel, full_tensor, fully_shard,
                            init_device_mesh, init_empty_weights, parallelize_module)

ROWS_PER_RANK, DIM, HIDDEN = 3, 8, 12


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(DIM, HIDDEN), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(torch.relu(self.norm(self.up(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def shard(net, **options):
    for b in net.blocks:
        fully_shard(b, **options)
    return fully_shard(net, **options)


def batch(step, ranks, dtype, sharded):
    torch.manual_seed(200 + step)
    x = torch.randn(ranks * ROWS_PER_RANK, DIM, dtype=dtype)
    return x[dist.get_rank() * ROWS_PER_RANK:][:ROWS_PER_RANK] if sharded else x


def step(net, s, dtype, sharded, opt):
    opt.zero_grad()
    out = net(batch(s, dist.get_world_size(), dtype, sharded))
    loss = (out.float() if dtype == torch.bfloat16 else out).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.detach()


def assert_params_match(net, reference, tolerance):
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        assert p.dtype == q.dtype and p.grad.dtype == q.dtype, name
        torch.testing.assert_close(full_tensor(p), q.detach(), **tolerance, msg=name)


TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-9, atol=1e-11),
             torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def train_alike(reference, net, dtype):
    """Two SGD steps of the reference on the whole batch and of net on this rank's rows; then their
    parameters match."""
    ref_opt, opt = torch.optim.SGD(reference.parameters(), lr=0.1), torch.optim.SGD(net.parameters(), lr=0.1)
    for s in range(2):
        step(reference, s, dtype, False, ref_opt)
        step(net, s, dtype, True, opt)
    assert_params_match(net, reference, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("reshard", [True, False])
def test_a_module_cast_after_fully_shard_trains_like_the_reference_cast_alike(dtype, reshard):
    reference = Net().to(dtype)
    net = shard(Net(), reshard_after_forward=reshard).to(dtype)
    ref_opt, opt = torch.optim.AdamW(reference.parameters(), lr=1e-2), torch.optim.AdamW(net.parameters(), lr=1e-2)
    for s in range(3):
        step(reference, s, dtype, False, ref_opt)
        step(net, s, dtype, True, opt)
        assert_params_match(net, reference, TOLERANCE[dtype])


def test_a_cast_between_training_steps_and_back():
    reference, net = Net(), shard(Net())
    ref_opt, opt = torch.optim.SGD(reference.parameters(), lr=0.1), torch.optim.SGD(net.parameters(), lr=0.1)
    for s, dtype in enumerate((torch.float32, torch.float64, torch.float32)):
        reference.to(dtype), net.to(dtype)
        step(reference, s, dtype, False, ref_opt)
        step(net, s, dtype, True, opt)
        assert_params_match(net, reference, TOLERANCE[torch.float32])


def test_a_cast_beside_a_mixed_precision_policy_keeps_the_policys_gathers():
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    net, seen = shard(Net(), mp_policy=policy).double(), []
    net.blocks[0].up.register_forward_hook(lambda m, args, out: seen.append((m.weight.dtype, out.dtype)))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step(net, 0, torch.float64, True, opt)
    assert seen == [(torch.bfloat16, torch.bfloat16)]
    assert all(p.dtype == torch.float64 and p.grad.dtype == torch.float64 for p in net.parameters())


@pytest.mark.parametrize("region", ["none", "checkpoint"])
def test_a_cast_between_a_forward_and_its_backward_is_a_clear_error_and_training_goes_on(region):
    reference, net = Net().double(), shard(Net())
    if region == "checkpoint":
        forward = Block.forward
        for b in net.blocks:
            b.forward = (lambda block: lambda x: checkpoint(forward, block, x, use_reentrant=False))(b)
    loss = net(batch(0, dist.get_world_size(), torch.float32, True)).pow(2).mean()
    net.double()
    with pytest.raises(ValueError, match="to keep the dtype and device their forward read them in until its "
                                         "backward, got them converted to Double on cpu"):
        loss.backward()
    del loss
    train_alike(reference, net, torch.float64)


def test_a_forward_never_backpropagated_then_a_cast_then_a_reentrant_checkpoint_trains():
    """The views a recomputation would reuse are of the buffers before the cast: they go with them."""
    reference, net = Net().double(), shard(Net())
    net(batch(0, dist.get_world_size(), torch.float32, True))  # with grad, no backward
    net.double()
    ref_opt, opt = torch.optim.SGD(reference.parameters(), lr=0.1), torch.optim.SGD(net.parameters(), lr=0.1)
    for s in range(2):
        step(reference, s, torch.float64, False, ref_opt)
        opt.zero_grad()
        x = batch(s, dist.get_world_size(), torch.float64, True).requires_grad_()
        checkpoint(net, x, use_reentrant=True).pow(2).mean().backward()
        opt.step()
    assert_params_match(net, reference, TOLERANCE[torch.float64])


def test_a_conversion_inside_the_forward_is_a_clear_error_and_training_goes_on():
    reference, net = Net(), shard(Net())
    handle = net.blocks[1].register_forward_pre_hook(lambda m, args: net.float() and None)
    with pytest.raises(ValueError, match="FSDPModule: expected a conversion .* of FSDPNet outside its forward and "
                                         "backward, got one while its gathered parameters stand in for the shards"):
        net(batch(0, dist.get_world_size(), torch.float32, True))
    handle.remove()
    train_alike(reference, net, torch.float32)


def test_a_cast_of_part_of_a_group_is_a_clear_error():
    net = shard(Net())
    net.blocks[0].up.double()
    with pytest.raises(ValueError, match=r"expected one dtype for a group's parameters .* got Double for up.weight "
                                         r"and Float for norm.weight \(a cast of part of the group\)"):
        net(batch(0, dist.get_world_size(), torch.float64, True))


def test_data_replaced_by_a_tensor_of_another_size_is_a_clear_error():
    net = shard(Net())
    with torch.no_grad():
        net.head.weight.data = torch.zeros(3, DIM)  # the whole weight, not this rank's piece
    pieces = -(-3 // dist.get_world_size())
    local = min(pieces, max(0, 3 - dist.get_rank() * pieces)) * DIM
    with pytest.raises(ValueError, match=rf"expected head.weight to stay this rank's piece of it \(shape "
                                         rf"\[{local // DIM}, {DIM}\] on cpu\), got shape \[3, {DIM}\] on cpu"):
        net(batch(0, dist.get_world_size(), torch.float32, True))


def test_data_that_is_the_piece_of_some_ranks_only_is_an_error_on_every_rank_not_a_hang():
    ws, r = dist.get_world_size(), dist.get_rank()
    net, first_piece = shard(Net()), -(-3 // ws)
    net.head.bias.data = torch.zeros(first_piece)  # rank 0's piece size; the last rank's is smaller
    last = 3 - (ws - 1) * first_piece
    if last == first_piece:
        pytest.skip("every rank's piece of the head's bias has one size")
    if r == ws - 1:
        with pytest.raises(ValueError, match=rf"expected head.bias to stay this rank's piece of it \(shape "
                                             rf"\[{max(last, 0)}\] on cpu\), got shape \[{first_piece}\]"):
            net(batch(0, ws, torch.float32, True))
    else:
        with pytest.raises(RuntimeError, match=r"expected every rank to gather the group \(head.weight, head.bias\)"):
            net(batch(0, ws, torch.float32, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_data_replaced_while_a_gather_is_in_flight_is_gathered_again(dtype):
    changed_first, changed_after = shard(Net()).to(dtype), shard(Net()).to(dtype)
    x = batch(0, dist.get_world_size(), dtype, True)
    with torch.no_grad():
        for p in changed_first.parameters():
            p.data = p.data * 0.5
        # The root's group: the head, whose piece is empty on rank 3 at 4 ranks (it must gather again too).
        handle = changed_after.unshard(async_op=True)
        for p in changed_after.parameters():
            p.data = p.data * 0.5
        assert torch.equal(changed_after(x), changed_first(x))
    handle.wait()
    assert changed_after._fsdp_group.gather_stats["regathered"] == 1


def test_a_cast_with_a_gather_in_flight_or_gathered_drops_it_and_gathers_in_the_new_dtype():
    reference, in_flight, gathered = Net().double(), shard(Net()), shard(Net(), reshard_after_forward=False)
    in_flight.unshard(async_op=True)
    gathered.unshard()
    x = batch(0, dist.get_world_size(), torch.float64, True)
    with torch.no_grad():
        expected = reference(batch(0, dist.get_world_size(), torch.float64, False))
        rows = expected[dist.get_rank() * ROWS_PER_RANK:][:ROWS_PER_RANK]
        for net in (in_flight, gathered):
            torch.testing.assert_close(net.double()(x), rows, **TOLERANCE[torch.float64])


def test_a_cast_that_makes_new_parameters_puts_them_in_the_group():
    """torch.__future__'s overwrite flag: every conversion makes new Parameter objects."""
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        reference, net = Net().double(), shard(Net())
        old = list(net.parameters())
        net.double()
        assert all(p is not q for p, q in zip(net.parameters(), old))
        train_alike(reference, net, torch.float64)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)


def test_a_parameter_assigned_after_fully_shard_joins_the_group_or_is_a_clear_error():
    net, x = shard(Net()), batch(0, dist.get_world_size(), torch.float32, True)
    before = full_tensor(net.head.weight)
    net.head.weight = nn.Parameter(net.head.weight.detach() * 2)  # this rank's piece: the group's now
    net(x)
    assert torch.equal(full_tensor(net.head.weight), before * 2)
    net.head.bias = nn.Parameter(torch.zeros(3))  # the whole bias, not this rank's piece
    with pytest.raises(ValueError, match=r"expected head.bias to stay this rank's piece of it \(shape \[\d\] on "
                                         r"cpu\), got shape \[3\] on cpu \(its .data replaced, or the parameter "
                                         r"assigned anew, by another tensor\)"):
        net(x)


def load_pieces(net, reference):
    """Each rank's piece (torch.chunk rows) of the reference's parameters, into net's shards."""
    ws, r = dist.get_world_size(), dist.get_rank()
    with torch.no_grad():
        for p, q in zip(net.parameters(), reference.parameters()):
            rows = -(-q.shape[0] // ws)
            p.copy_(q[r * rows:(r + 1) * rows])


@pytest.mark.parametrize("reshard", [True, False])
def test_fully_shard_on_meta_then_to_empty_and_an_initialization_trains_like_the_reference(reshard):
    reference, net = Net(), shard(Net().to("meta"), reshard_after_forward=reshard)
    assert all(p.is_meta for p in net.parameters())
    materialize_and_train_alike(net, reference, steps=3)


def materialize_and_train_alike(net, reference, steps):
    """to_empty, each rank's pieces of the reference's values, then AdamW steps alike."""
    net.to_empty(device="cpu")
    assert all(p.device.type == "cpu" for p in net.parameters())
    load_pieces(net, reference)
    ref_opt, opt = torch.optim.AdamW(reference.parameters(), lr=1e-2), torch.optim.AdamW(net.parameters(), lr=1e-2)
    for s in range(steps):
        step(reference, s, torch.float32, False, ref_opt)
        step(net, s, torch.float32, True, opt)
        assert_params_match(net, reference, TOLERANCE[torch.float32])


def test_reset_parameters_after_to_empty_initializes_each_rank_s_piece():
    net = shard(Net().to("meta"))
    net.to_empty(device="cpu")
    for m in net.modules():
        if isinstance(m, (nn.Linear, nn.LayerNorm)):
            m.reset_parameters()
    # kaiming_uniform_(a=sqrt(5)) reads fan_in, which a dim-0 piece keeps.
    up = full_tensor(net.blocks[0].up.weight)
    assert up.shape == (HIDDEN, DIM) and 0 < up.abs().max() <= 1 / DIM ** 0.5
    loss = step(net, 0, torch.float32, True, torch.optim.SGD(net.parameters(), lr=0.1))
    assert torch.isfinite(loss) and all(torch.isfinite(full_tensor(p)).all() for p in net.parameters())


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.emb, self.mix, self.head = nn.Embedding(10, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.emb(ids))))


def test_a_tied_weight_stays_one_tensor_through_to_empty():
    ws, r = dist.get_world_size(), dist.get_rank()
    reference, meta = Tied(), Tied().to("meta")
    meta.head.weight = meta.emb.weight  # torch 1.13's .to("meta") made one tensor per holder
    net = fully_shard(meta)
    net.to_empty(device="cpu")
    assert net.head.weight is net.emb.weight and net.head.weight.device.type == "cpu"
    load_pieces(net, reference)
    ref_opt, opt = torch.optim.SGD(reference.parameters(), lr=0.1), torch.optim.SGD(net.parameters(), lr=0.1)
    for s in range(2):
        torch.manual_seed(300 + s)
        ids = torch.randint(0, 10, (ws * 4,))
        for module, optimizer, batch_ids in ((reference, ref_opt, ids), (net, opt, ids[r * 4:][:4])):
            optimizer.zero_grad()
            module(batch_ids).pow(2).mean().backward()
            optimizer.step()
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p), q.detach(), rtol=1e-5, atol=1e-6)


def test_a_forward_before_to_empty_is_a_clear_error():
    net = shard(Net().to("meta"))
    with pytest.raises(ValueError, match=r"expected head.weight on cpu when its group gathers, got it on "
                                         r"meta \(materialize the module passed to fully_shard: "
                                         r"module.to_empty\(device=\"cpu\"\), then initialize it\)"):
        net(batch(0, dist.get_world_size(), torch.float32, True))


def test_a_group_made_partly_on_meta_trains_once_materialized():
    """A cpu body with a new head made on meta: one group whose first parameter is a cpu one."""
    reference, net = Net(), Net()
    net.head = nn.Linear(DIM, 3, device="meta")
    net = fully_shard(net)
    net.to_empty(device="cpu")
    load_pieces(net, reference)
    train_alike(reference, net, torch.float32)


def test_a_holder_converted_alone_into_new_parameters_trains_them():
    """torch.__future__'s overwrite flag, with the conversion on a module that holds parameters of
    a group but is not the one passed to fully_shard: its next forward takes them into the group."""
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        reference, net = Net(), shard(Net())
        reference.head.double(), net.head.double()  # new Parameter objects in head alone
        for module in (reference, net):
            module.head.forward = (lambda head: lambda x: nn.Linear.forward(head, x.double()))(module.head)
        train_alike(reference, net, torch.float32)
        assert net.head.weight.dtype == torch.float64
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)


def test_tensor_parallel_and_fully_shard_on_a_meta_model_on_a_2x2_mesh():
    if dist.get_world_size() != 4:
        pytest.skip("needs 4 ranks")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()

    def build(meta):
        net = Net().to("meta") if meta else Net()
        for b in net.blocks:
            b.norm = nn.Identity()
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        return shard(net, mesh=mesh["dp"])

    eager, meta = build(False), build(True)
    meta.to_empty(device="cpu")
    with torch.no_grad():
        for p, q in zip(meta.parameters(), eager.parameters()):
            p.copy_(q)
    for net in (eager, meta):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for s in range(2):
            opt.zero_grad()
            x = batch(s, 2, torch.float32, False)[dp * ROWS_PER_RANK:][:ROWS_PER_RANK]
            net(x).pow(2).mean().backward()
            opt.step()
    for p, q in zip(meta.parameters(), eager.parameters()):
        assert torch.equal(full_tensor(p), full_tensor(q))


def test_the_inputs_are_cast_after_the_pre_hooks_registered_before_fully_shard():
    """fully_shard's gather runs ahead of a module's earlier pre-hooks, as FSDP2's (prepend=True),
    but its cast runs after them: a tensor-parallel style's hook there reads its input's layout tag,
    which a cast (a new tensor) would drop."""
    net = Net()
    seen = []
    net.register_forward_pre_hook(lambda mod, args: seen.append((args[0].dtype, mod.head.weight.shape)))
    net.register_forward_hook(lambda mod, args, out: seen.append(args[0].dtype))
    shard(net, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float64))
    net(batch(0, dist.get_world_size(), torch.float32, True))
    assert seen == [(torch.float32, torch.Size([3, DIM])), torch.float64]


def test_init_empty_weights_builds_on_meta_for_fully_shard():
    """The original's init_empty_weights: parameters on meta, then fully_shard, to_empty and this
    rank's pieces train like the reference (tests/python/ut/test_init_weights.py: the rest)."""
    reference = Net()
    with init_empty_weights():
        net = Net()
    assert all(p.is_meta and isinstance(p, nn.Parameter) for p in net.parameters())
    shard(net)
    materialize_and_train_alike(net, reference, steps=2)
