"""fully_shard gathers a group for the whole forward of the module it was applied to: a parameter
read there outside its own module's forward (a GPT's position table sliced by the root, a head
tied to the token embedding, nn.MultiheadAttention's out_proj, a root's own parameter around
its children) is the whole parameter, as in FSDP2. At 2 and 4 ranks against the full-batch
single-process reference, with reshard_after_forward on and off, blocks sharded on their own or
not, and the blocks under torch.utils.checkpoint (both variants). A forward that raises puts the
shards back, also one caught inside the module's forward; owners called on their own reshard
once each has run; a call that would leave a holder reading its piece, and two passes that the
buckets cannot reduce, are clear errors. A checkpointed region that reads a parameter itself
recomputes with the whole parameter (its modules hold views of the gathered parameters for the
group's backward), and a reentrant one's gradient of it is reduced and added. Pre-hooks registered
before fully_shard (weight_norm's) and RNNs (their cached weight list) read the whole parameters."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hyper_parallel import full_tensor, fully_shard, init_device_mesh

# 16 positions: every rank's piece of the table has the 4 rows a slice reads (wrong ones, unless
# the table is gathered).
ROWS_PER_RANK, TOKENS, DIM, HIDDEN, VOCAB, MAX_TOKENS = 2, 4, 8, 12, 11, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)
        self.fail = False

    def forward(self, x):
        h = torch.relu(self.up(x))
        if self.fail:
            raise ArithmeticError("a forward that raises")
        return x + self.down(h)


class GPT(nn.Module):
    """Reads wpe.weight outside its embedding's forward, and its own scale around its children's;
    its head reads wte.weight ("read"), holds it ("module"), or has its own (None)."""

    def __init__(self, tied="read", checkpointed=None):
        super().__init__()
        torch.manual_seed(3)
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(MAX_TOKENS, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, DIM))
        self.head = None if tied == "read" else nn.Linear(DIM, VOCAB, bias=False)
        if tied == "module":
            self.head.weight = self.wte.weight
        self.checkpointed = checkpointed  # None, or use_reentrant

    def forward(self, ids):
        h = self.wte(ids) * self.scale + self.wpe.weight[:ids.shape[1]]
        for b in self.blocks:
            h = b(h) if self.checkpointed is None else checkpoint(b, h, use_reentrant=self.checkpointed)
        h = self.norm(h) * self.scale
        return F.linear(h, self.wte.weight) if self.head is None else self.head(h)


class Attention(nn.Module):
    """nn.MultiheadAttention reads out_proj's parameters in its own forward (recomputed in the
    backward when checkpointed)."""

    def __init__(self, checkpointed=None):
        super().__init__()
        torch.manual_seed(4)
        self.wte = nn.Embedding(VOCAB, DIM)
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.head = nn.Linear(DIM, VOCAB)
        self.checkpointed = checkpointed  # None, or use_reentrant

    def forward(self, ids):
        h = self.wte(ids)
        if self.checkpointed is None:
            return self.head(h + self.attn(h, h, h, need_weights=False)[0])
        return self.head(h + checkpoint(lambda t: self.attn(t, t, t, need_weights=False)[0], h,
                                        use_reentrant=self.checkpointed))


def ids_of(step, ranks):
    torch.manual_seed(200 + step)
    return torch.randint(0, VOCAB, (ranks * ROWS_PER_RANK, TOKENS))


def train(net, sharded, steps=3):
    """SGD: attention's key bias has a gradient of rounding noise only, which AdamW would scale up
    to steps of its learning rate."""
    ws, r = dist.get_world_size(), dist.get_rank()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    for s in range(steps):
        ids = ids_of(s, ws)
        if sharded:
            ids = ids[r * ROWS_PER_RANK:][:ROWS_PER_RANK]
        opt.zero_grad()
        logits = net(ids)
        F.cross_entropy(logits.reshape(-1, VOCAB), ids.roll(1, 1).reshape(-1)).backward()
        opt.step()
    return [full_tensor(p) for p in net.parameters()] if sharded else [p.detach() for p in net.parameters()]


def dp_mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))


def assert_trains_like(make, shard_blocks, **options):
    reference = train(make(), sharded=False)
    net = make()
    for b in (net.blocks if shard_blocks else ()):
        fully_shard(b, mesh=dp_mesh(), **options)
    params = train(fully_shard(net, mesh=dp_mesh(), **options), sharded=True)
    for (name, _), p, q in zip(net.named_parameters(), params, reference):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("tied", [None, "read", "module"])
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("shard_blocks", [True, False])
def test_a_root_reading_sliced_and_tied_parameters_trains_as_one_process(tied, reshard, shard_blocks):
    assert_trains_like(lambda: GPT(tied), shard_blocks, reshard_after_forward=reshard)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_tied_parameters_with_checkpointed_blocks_train_as_one_process(use_reentrant):
    for shard_blocks in (True, False):
        assert_trains_like(lambda: GPT(checkpointed=use_reentrant), shard_blocks, comm_fusion=shard_blocks)


@pytest.mark.parametrize("checkpointed", [None, False, True])
@pytest.mark.parametrize("reshard", [True, False])
def test_multihead_attention_reads_its_out_proj_whole(reshard, checkpointed):
    assert_trains_like(lambda: Attention(checkpointed), False, reshard_after_forward=reshard)


class CheckpointsARegion(GPT):
    """Checkpoints a function of its own that reads the position table itself: its recomputation
    in the backward runs outside every module's forward (with blocks sharded on their own, the
    region calls none of the root group's modules)."""

    def region(self, h):
        h = h + self.wpe.weight[:h.shape[1]]
        for b in self.blocks:
            h = b(h)
        return h

    def forward(self, ids):
        h = checkpoint(self.region, self.wte(ids) * self.scale, use_reentrant=self.checkpointed)
        return F.linear(self.norm(h) * self.scale, self.wte.weight)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("shard_blocks", [True, False])
@pytest.mark.parametrize("options", [{}, {"reshard_after_forward": False}, {"comm_fusion": True}])
def test_a_checkpointed_region_reading_a_parameter_itself_recomputes_it_whole(use_reentrant, shard_blocks, options):
    assert_trains_like(lambda: CheckpointsARegion(checkpointed=use_reentrant), shard_blocks, **options)


def test_a_backward_that_raises_puts_the_shards_back_and_training_goes_on():
    """The owning modules hold views of the gathered parameters during the backward: one that
    raises inside the group's backward must not leave them there for an optimizer or a save."""
    ws, r = dist.get_world_size(), dist.get_rank()
    net = fully_shard(CheckpointsARegion(checkpointed=False), mesh=dp_mesh())
    shards = [p.detach().clone() for p in net.parameters()]

    def raises(grad):
        raise ArithmeticError("a backward that raises")

    handle = net.blocks[1].register_forward_hook(lambda mod, args, out: out.register_hook(raises) and None)
    loss = net(ids_of(0, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK]).sum()
    with pytest.raises(ArithmeticError):
        loss.backward()
    handle.remove()
    del loss
    assert all(isinstance(p, nn.Parameter) and torch.equal(p.detach(), q) for p, q in zip(net.parameters(), shards))
    for p, q in zip(train(net, sharded=True), train(CheckpointsARegion(checkpointed=False), sharded=False)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


class PositionsInARegion(GPT):
    """A reentrant region that reads the root group's table itself and calls none of its modules,
    before every other use of the group: in the backward, the group's other gradients all come
    before the region's recomputation."""

    def region(self, h):
        return h + self.wpe.weight[:h.shape[1]]

    def forward(self, ids):
        h = checkpoint(self.region, self.wte(ids), use_reentrant=True)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h) * self.scale)


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("comm_fusion", [False, True])
def test_a_reentrant_region_read_before_the_rest_of_its_group_keeps_it_gathered(reshard, comm_fusion):
    reference, net = train(PositionsInARegion(tied=None), sharded=False), PositionsInARegion(tied=None)
    fully_shard(net.wte, mesh=dp_mesh())
    params = train(fully_shard(net, mesh=dp_mesh(), reshard_after_forward=reshard, comm_fusion=comm_fusion),
                   sharded=True)
    for (name, _), p, q in zip(net.named_parameters(), params, reference):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


class ScaleInARegion(GPT):
    """A region that reads the root's scale itself, which the root reads again after it: with the
    blocks sharded on their own, every gradient of the root group comes through the outer graph
    before the region is recomputed."""

    def region(self, h):
        h = h * self.scale
        for b in self.blocks:
            h = b(h)
        return h

    def forward(self, ids):
        h = checkpoint(self.region, self.wte(ids), use_reentrant=self.checkpointed)
        return self.head(self.norm(h) * self.scale)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("comm_fusion", [False, True])
@pytest.mark.parametrize("shard_blocks", [True, False])
def test_a_group_whose_gradients_all_came_stays_gathered_for_the_region_of_its_module(
        use_reentrant, comm_fusion, shard_blocks):
    """Without the blocks' own groups, a reentrant region's recomputation brings the scale's
    gradient of its read before the outer graph brings the rest: both count."""
    make = lambda: ScaleInARegion(tied=None, checkpointed=use_reentrant)  # noqa: E731
    assert_trains_like(make, shard_blocks=shard_blocks, comm_fusion=comm_fusion)


def test_a_hooked_parameter_trains_beside_a_reentrant_region_reading_one_itself():
    """A gradient hook on the norm's weight (its bucket ends at it) and the whole-group node."""

    def make():
        net = CheckpointsARegion(checkpointed=True)
        net.norm.weight.register_hook(lambda grad: grad * 2)
        return net

    assert_trains_like(make, shard_blocks=False, comm_fusion=True)


def test_a_backward_hook_reading_a_parameter_of_a_module_whose_backward_is_over_reads_its_shard():
    """As before backward views, and as in FSDP2 (a sharded DTensor): the module's backward is
    over, so its shards are back."""
    ws, r = dist.get_world_size(), dist.get_rank()
    net = GPT(tied=None)
    for b in net.blocks:
        fully_shard(b, mesh=dp_mesh())
    fully_shard(net, mesh=dp_mesh())
    seen = []
    net.blocks[0].register_full_backward_hook(lambda mod, gin, gout: seen.append(net.blocks[1].down.weight))
    for step in range(2):
        net(ids_of(step, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK]).sum().backward()
    assert len(seen) == 2 and all(w is net.blocks[1].down.weight for w in seen)


@pytest.mark.parametrize("reshard", [True, False])
def test_a_hook_on_the_roots_output_reads_whole_parameters(reshard):
    """It runs before the output's pre-backward node gathers the group again (resharded after the
    forward): the backward views it sees are of the group gathered for it, not of freed buffers."""
    ws, r = dist.get_world_size(), dist.get_rank()
    reference, net = GPT(tied=None), fully_shard(GPT(tied=None), mesh=dp_mesh(), reshard_after_forward=reshard)
    ids = ids_of(0, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK]
    seen = []
    out = net(ids)
    out.register_hook(lambda grad: seen.append(net.head.weight.detach().clone()))
    out.sum().backward()
    assert torch.equal(seen[0], reference.head.weight.detach())


def test_a_state_dict_inside_the_forward_gives_the_pieces():
    """Not aliases of the gathered buffers, which the group frees after its forward."""
    from hyper_parallel.core.fully_shard import get_model_state_dict  # pylint: disable=import-outside-toplevel

    net = GPT(tied=None)
    fully_shard(net.blocks[0], mesh=dp_mesh())
    fully_shard(net, mesh=dp_mesh())
    inside, errors = [], []

    def hook(mod, args, output):
        inside.append(net.state_dict())
        try:
            get_model_state_dict(net)
        except ValueError as error:
            errors.append(str(error))

    net.blocks[1].register_forward_hook(hook)
    net(ids_of(0, 1))
    outside = net.state_dict()
    assert list(inside[0]) == list(outside)
    assert all(torch.equal(inside[0][k], v) for k, v in outside.items())
    assert "expected a call outside the forward and backward of the model's fully_shard modules" in errors[0]


def test_two_backwards_of_one_forward_recompute_the_region_whole():
    """retain_graph: the second backward of the first step reduces by the plan the first made."""
    ws, r = dist.get_world_size(), dist.get_rank()
    reference, net = PositionsInARegion(tied=None), PositionsInARegion(tied=None)
    fully_shard(net.wte, mesh=dp_mesh())
    fully_shard(net, mesh=dp_mesh())
    ids = ids_of(0, ws)
    for loss in (net(ids[r * ROWS_PER_RANK:][:ROWS_PER_RANK]).sum(), reference(ids).sum()):
        loss.backward(retain_graph=True)
        loss.backward()
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p, p.grad), q.grad / ws, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_a_checkpointed_region_reading_a_parameter_itself_accumulates_without_sync():
    """Two micro-batches, the first without gradient sync: the region's gradient of the table
    (a reentrant checkpoint's) is kept for the synced backward."""
    ws, r = dist.get_world_size(), dist.get_rank()
    reference, net = CheckpointsARegion(checkpointed=True), CheckpointsARegion(checkpointed=True)
    for b in net.blocks:
        fully_shard(b, mesh=dp_mesh())
    fully_shard(net, mesh=dp_mesh())
    for micro in range(2):
        ids = ids_of(micro, ws)
        net.set_requires_gradient_sync(micro == 1)
        net(ids[r * ROWS_PER_RANK:][:ROWS_PER_RANK]).sum().backward()
        reference(ids).sum().backward()
    assert all(isinstance(p, nn.Parameter) for p in net.parameters())
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p, p.grad), q.grad / ws, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_an_owning_module_called_on_its_own_still_gathers_and_puts_the_shards_back():
    """Outside the root's forward (FSDP2 has no such call) a module that owns managed parameters
    gathers them for its call, and the shards are the parameters after it."""
    ws, r = dist.get_world_size(), dist.get_rank()
    reference, net = GPT(), fully_shard(GPT(), mesh=dp_mesh())
    ids = ids_of(0, ws)
    h = net.blocks[0](net.wte(ids[r * ROWS_PER_RANK:][:ROWS_PER_RANK]))
    torch.testing.assert_close(h, reference.blocks[0](reference.wte(ids))[r * ROWS_PER_RANK:][:ROWS_PER_RANK])
    pieces = torch.chunk(reference.wte.weight.detach(), ws, 0)
    assert torch.equal(net.wte.weight.detach(), pieces[r] if r < len(pieces) else pieces[0][:0])


def test_a_call_that_would_leave_a_holder_reading_its_piece_is_a_clear_error():
    """fully_shard on a child after its parent, or on one of two modules sharing a parameter
    before their parent: the holder's forward would read this rank's piece."""
    net = fully_shard(GPT(), mesh=dp_mesh())
    with pytest.raises(ValueError, match=r"expected up\.weight unmanaged.*above or beside it"):
        fully_shard(net.blocks[0], mesh=dp_mesh())
    net = GPT(tied="module")
    fully_shard(net.wte, mesh=dp_mesh())
    with pytest.raises(ValueError, match=r"expected head\.weight unmanaged.*the call on wte, which does not hold it"):
        fully_shard(net, mesh=dp_mesh())


@pytest.mark.parametrize("shard_blocks", [True, False])
def test_a_forward_that_raises_puts_the_shards_back_and_training_goes_on(shard_blocks):
    ws, r = dist.get_world_size(), dist.get_rank()
    net = GPT()
    for b in (net.blocks if shard_blocks else ()):
        fully_shard(b, mesh=dp_mesh())
    fully_shard(net, mesh=dp_mesh())
    shards = [p.detach().clone() for p in net.parameters()]
    net.blocks[1].fail = True
    with pytest.raises(ArithmeticError):
        net(ids_of(0, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK])
    net.blocks[1].fail = False
    assert all(isinstance(p, nn.Parameter) and torch.equal(p.detach(), q) for p, q in zip(net.parameters(), shards))
    # A direct call of a module (its group freed meanwhile) gathers afresh.
    net._fsdp_group.reshard()
    with torch.no_grad():
        net.wte(ids_of(0, 1))
    reference = train(GPT(), sharded=False)
    for p, q in zip(train(net, sharded=True), reference):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


class SecondCallSkips(GPT):
    def forward(self, ids, skip=False):
        h = self.wte(ids)
        for i, b in enumerate(self.blocks):
            h = h if skip and i == 1 else b(h)
        return F.linear(h, self.wte.weight)


def test_two_passes_the_buckets_cannot_reduce_are_an_error_naming_the_ways_out():
    """A second forward before the backward that skips a block, with only the root sharded: its
    views and the first pass's reach one reduction in buckets."""
    ws, r = dist.get_world_size(), dist.get_rank()
    ids = ids_of(0, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK]
    for comm_fusion in (True, False):
        net = fully_shard(SecondCallSkips(), mesh=dp_mesh(), comm_fusion=comm_fusion)
        loss = net(ids).sum() + net(ids, skip=True).sum()
        if comm_fusion:
            loss.backward()
            continue
        with pytest.raises(NotImplementedError, match=r"expected one gradient of .* per backward of its group.*"
                                                      r"use_reentrant=False.*comm_fusion=True"):
            loss.backward()


class CatchesItsBlock(GPT):
    """Computes a block with its parameters read directly when calling it raises, inside the
    sharded module's forward."""

    def forward(self, ids):
        h = self.wte(ids) * self.scale + self.wpe.weight[:ids.shape[1]]
        for b in self.blocks:
            try:
                h = b(h)
            except ArithmeticError:
                h = h + F.linear(torch.relu(F.linear(h, b.up.weight, b.up.bias)), b.down.weight, b.down.bias)
        return F.linear(self.norm(h) * self.scale, self.wte.weight)


@pytest.mark.parametrize("reshard", [True, False])
def test_a_raise_caught_inside_the_forward_ends_the_owners_call_with_it(reshard):
    ws, r = dist.get_world_size(), dist.get_rank()
    reference, net = GPT(), fully_shard(CatchesItsBlock(), mesh=dp_mesh(), reshard_after_forward=reshard)

    def unavailable(module, args):
        raise ArithmeticError("a fast path that is not available")

    # Raised inside an owner's call (after fully_shard's pre-hook), which then never ends.
    net.blocks[1].up.register_forward_pre_hook(unavailable)
    shapes = [p.shape for p in net.parameters()]
    ids = ids_of(0, ws)
    loss = net(ids[r * ROWS_PER_RANK:][:ROWS_PER_RANK]).sum()
    assert [p.shape for p in net.parameters()] == shapes
    assert net._fsdp_group.is_unsharded == (not reshard)
    loss.backward()
    reference(ids).sum().backward()
    for p, q in zip(net.parameters(), reference.parameters()):
        # The reduction averages the ranks' sums.
        torch.testing.assert_close(full_tensor(p, p.grad), q.grad / ws, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("root_owns_one", [False, True])
def test_owners_called_on_their_own_reshard_once_each_has_run(root_owns_one):
    """wte, blocks and norm called directly (an evaluation outside the root's forward; the table
    only the root's forward reads is left out): the root's own parameter is read only by its
    forward, so it does not hold the pass open."""
    ws = dist.get_world_size()
    net = GPT()
    del net.wpe
    if not root_owns_one:
        del net.scale
        net.scale = torch.ones(DIM)
    fully_shard(net, mesh=dp_mesh())
    with torch.no_grad():
        h = net.wte(ids_of(0, ws))
        for b in net.blocks:
            h = b(h)
        net.norm(h)
    assert not net._fsdp_group.is_unsharded


class WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, DIM)

    def forward(self, x):
        return self.up(x.relu_())


def test_a_sharded_module_may_write_its_input_in_place():
    """Its inputs pass through the node that ends its backward: not as views, which torch
    forbids writing in place."""
    ws, r = dist.get_world_size(), dist.get_rank()

    def make():
        torch.manual_seed(5)
        return nn.Sequential(nn.Linear(DIM, DIM), WritesItsInput())

    reference, net = make(), make()
    fully_shard(net[1], mesh=dp_mesh())
    fully_shard(net, mesh=dp_mesh())
    torch.manual_seed(6)
    x = torch.randn(ws * ROWS_PER_RANK, DIM)
    net(x[r * ROWS_PER_RANK:][:ROWS_PER_RANK]).sum().backward()
    reference(x).sum().backward()
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p, p.grad), q.grad / ws, rtol=1e-5, atol=1e-5)


class AppendsToAList(Block):
    def forward(self, x, sink):
        sink.append(x.shape[0])
        return super().forward(x)


def test_a_sharded_module_gets_the_callers_lists():
    """Its inputs pass through the post-backward node; the containers it gets are the caller's."""
    net = fully_shard(AppendsToAList(), mesh=dp_mesh())
    sink = []
    net(torch.randn(2, DIM, requires_grad=True), sink)
    net(torch.randn(3, DIM), sink)
    assert sink == [2, 3]


class ChecksPartOfItself(Block):
    """A reentrant region of its own forward reads down's weight itself."""

    def region(self, x):
        return x + F.linear(torch.relu(self.up(x)), self.down.weight, self.down.bias)

    def forward(self, x):
        return checkpoint(self.region, x, use_reentrant=True)


class ChecksPartOfBlocks(GPT):
    def __init__(self):
        super().__init__(tied=None)
        torch.manual_seed(7)
        self.blocks = nn.ModuleList(ChecksPartOfItself() for _ in range(2))

    def forward(self, ids):
        h = self.wte(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_a_block_whose_region_reads_its_parameter_is_freed_with_its_backward():
    """The region's gradient of down.weight arrives in the block's buckets: the block's backward
    ends with its own, not with the whole backward."""
    ws, r = dist.get_world_size(), dist.get_rank()
    assert_trains_like(ChecksPartOfBlocks, shard_blocks=True)
    net = ChecksPartOfBlocks()
    for b in net.blocks:
        fully_shard(b, mesh=dp_mesh())
    fully_shard(net, mesh=dp_mesh())
    for step in range(2):
        embedded = []
        handle = net.wte.register_forward_hook(lambda mod, args, out: embedded.append(out))
        loss = net(ids_of(step, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK]).sum()
        handle.remove()
        gathered = []
        embedded[0].register_hook(lambda grad: gathered.append([b._fsdp_group.is_unsharded for b in net.blocks]))
        loss.backward()
        assert gathered == [[False, False]], f"step {step}: {gathered}"


class WeightNormedGPT(GPT):
    """Its blocks' up projections under weight_norm, whose forward pre-hook computes the weight
    from weight_g and weight_v, and a pre-hook on each block that reads down.weight: all
    registered before fully_shard."""

    def __init__(self):
        super().__init__(tied=None)
        self.read_shapes = []
        for b in self.blocks:
            b.up = nn.utils.weight_norm(b.up)
            b.register_forward_pre_hook(lambda mod, args: self.read_shapes.append(tuple(mod.down.weight.shape)))


@pytest.mark.parametrize("reshard", [True, False])
def test_pre_hooks_registered_before_fully_shard_read_whole_parameters(reshard):
    """fully_shard's pre-hook runs ahead of a module's earlier ones, as FSDP2's (prepend=True)."""
    reference = train(WeightNormedGPT(), sharded=False)
    net = WeightNormedGPT()
    for b in net.blocks:
        fully_shard(b.up, mesh=dp_mesh(), reshard_after_forward=reshard)
        fully_shard(b, mesh=dp_mesh(), reshard_after_forward=reshard)
    params = train(fully_shard(net, mesh=dp_mesh(), reshard_after_forward=reshard), sharded=True)
    for (name, _), p, q in zip(net.named_parameters(), params, reference):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    assert set(net.read_shapes) == {(DIM, HIDDEN)}


class RemapsItsIds(GPT):
    """A pre-hook on the token embedding, registered before fully_shard, that remaps the ids."""

    def __init__(self):
        super().__init__(tied=None)
        self.wte.register_forward_pre_hook(lambda mod, args: ((args[0] * 3 + 1) % VOCAB,))


def test_a_row_sparse_embedding_gathers_the_rows_of_the_ids_its_pre_hooks_give():
    reference = train(RemapsItsIds(), sharded=False)
    net = RemapsItsIds()
    fully_shard(net.wte, mesh=dp_mesh())  # its own group: row-sparse
    params = train(fully_shard(net, mesh=dp_mesh()), sharded=True)
    for (name, _), p, q in zip(net.named_parameters(), params, reference):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


class Recurrent(nn.Module):
    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(5)
        self.rnn, self.head = getattr(nn, kind)(DIM, HIDDEN, batch_first=True), nn.Linear(HIDDEN, 1)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("own_group", [True, False])
def test_a_recurrent_layer_reads_its_whole_weights(kind, own_group):
    """An RNN reads its weights from a list its __setattr__ keeps, not from _parameters."""
    ws, r = dist.get_world_size(), dist.get_rank()
    reference, net = Recurrent(kind), Recurrent(kind)
    if own_group:
        fully_shard(net.rnn, mesh=dp_mesh())
    fully_shard(net, mesh=dp_mesh())
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, net)]
    for step in range(2):
        torch.manual_seed(300 + step)
        x = torch.randn(ws * ROWS_PER_RANK, TOKENS, DIM)
        for m, rows, opt in ((reference, x, opts[0]), (net, x[r * ROWS_PER_RANK:][:ROWS_PER_RANK], opts[1])):
            opt.zero_grad()
            m(rows).pow(2).mean().backward()
            opt.step()
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p), q.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
