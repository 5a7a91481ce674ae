"""fully_shard on a list of modules (FSDP2's and the original's ``fully_shard([model.norm,
model.head])``): one group of their parameters, gathered once by the first of them to run and
resharded once each has run, against the full-batch single-process reference and bitwise
against the same modules in the root's group: adjacent modules and modules with another group
between them, a module of the list called twice, HSDP with accumulation, checkpointed modules,
state_dict loading, and the errors a list can cause."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from hyper_parallel import FSDPModule, HSDPModule, full_tensor, fully_shard, init_device_mesh
from hyper_parallel.core import comm

from fully_shard_models import DIM, Block

ROWS_PER_RANK = 3


class Net(nn.Module):
    """Blocks, a norm and a head; ``twice``: the first block runs again after the last one;
    ``checkpointed``: the blocks run under torch.utils.checkpoint (reentrant or not)."""

    def __init__(self, twice=False, checkpointed=None):
        super().__init__()
        torch.manual_seed(7)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 2)
        self.twice, self.checkpointed = twice, checkpointed

    def forward(self, x):
        if self.checkpointed:  # a reentrant region whose input needs no gradient gives its parameters none
            x = x.detach().requires_grad_()
        for b in list(self.blocks) + ([self.blocks[0]] if self.twice else []):
            x = b(x) if self.checkpointed is None else checkpoint(b, x, use_reentrant=self.checkpointed)
        return self.head(self.norm(x))


def batch(step, ranks):
    torch.manual_seed(100 + step)
    return torch.randn(ranks * ROWS_PER_RANK, DIM)


def train(net, steps, replicas, replica=None, micro_batches=1):
    """AdamW steps on the mean of the squared outputs; each takes the whole batch (the
    reference) or this replica's rows of it, in micro-batches whose gradients are synchronized
    only in the last."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for s in range(steps):
        rows = batch(s, replicas) if replica is None else batch(s, replicas)[replica * ROWS_PER_RANK:][:ROWS_PER_RANK]
        opt.zero_grad()
        for m, x in enumerate(rows.chunk(micro_batches)):
            if isinstance(net, FSDPModule):
                net.set_requires_gradient_sync(m == micro_batches - 1)
            (net(x).pow(2).sum() / len(rows)).backward()
        opt.step()


def dp_mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))


def shard(net, lists, mesh, **options):
    """fully_shard on each block not in a list (or in a container in one), on each list, then on
    the root."""
    listed = {id(sub) for modules in lists for m in modules for sub in m.modules()}
    for b in net.blocks:
        if id(b) not in listed:
            fully_shard(b, mesh=mesh, **options)
    for modules in lists:
        assert fully_shard(modules, mesh=mesh, **options) is modules
    return fully_shard(net, mesh=mesh, **options)


def trained_reference(steps, **kwargs):
    reference = Net(**kwargs)
    train(reference, steps, replicas=dist.get_world_size())
    return reference


def assert_trained_as(net, reference):
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


def sharded_run(lists_of, mesh, steps=3, net_kwargs=None, **options):
    net = Net(**(net_kwargs or {}))
    shard(net, lists_of(net), mesh, **options)
    comm.reset_collective_counts()
    train(net, steps, replicas=dist.get_world_size(), replica=dist.get_rank())
    return net


@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("comm_fusion", [True, False])
def test_norm_and_head_in_one_group_train_bitwise_as_in_the_roots_group(reshard, comm_fusion):
    steps = 3
    reference = trained_reference(steps)
    in_root = sharded_run(lambda net: [], dp_mesh(), steps, reshard_after_forward=reshard, comm_fusion=comm_fusion)
    listed = sharded_run(lambda net: [[net.norm, net.head]], dp_mesh(), steps, reshard_after_forward=reshard,
                         comm_fusion=comm_fusion)
    assert_trained_as(listed, reference)
    for p, q in zip(listed.parameters(), in_root.parameters()):
        assert torch.equal(p.detach(), q.detach())
    group = listed.head._fsdp_group
    assert listed.norm._fsdp_group is group and listed._fsdp_group is None
    assert isinstance(listed.norm, HSDPModule) and isinstance(listed.head, FSDPModule)
    # One gather per forward (and one per backward when resharded after the forward).
    assert group.gather_stats["gathers"] == steps * (2 if reshard else 1)
    if comm_fusion:  # one reduce-scatter per group and step: three blocks and the list
        assert comm.collective_count("reduce_scatter") == steps * 4


@pytest.mark.parametrize("reshard", [True, False])
def test_modules_with_another_group_between_them_gather_once_per_pass(reshard):
    """The first block and the head in one group, the other blocks in their own: the list's
    group stays gathered while the others run, until its last module has."""
    steps = 2
    reference = trained_reference(steps)
    net = sharded_run(lambda net: [[net.blocks[0], net.head]], dp_mesh(), steps, reshard_after_forward=reshard,
                      comm_fusion=True)
    assert_trained_as(net, reference)
    assert net.head._fsdp_group.gather_stats["gathers"] == steps * (2 if reshard else 1)
    assert net._fsdp_group is not None  # the norm's
    assert comm.collective_count("reduce_scatter") == steps * 4


def test_a_container_in_the_list_stands_for_its_modules():
    """An nn.ModuleList is never called itself: its blocks (and the norm) make the group's pass,
    one gather per forward and one per backward."""
    steps = 2
    reference = trained_reference(steps)
    net = sharded_run(lambda net: [[net.blocks, net.norm]], dp_mesh(), steps, comm_fusion=True)
    assert_trained_as(net, reference)
    assert isinstance(net.blocks, FSDPModule) and net.blocks._fsdp_group is net.norm._fsdp_group
    assert net.norm._fsdp_group.gather_stats["gathers"] == steps * 2
    assert comm.collective_count("reduce_scatter") == steps * 2  # the list's and the root's (the head)


def test_a_module_of_the_list_called_twice_in_a_forward():
    reference = trained_reference(2, twice=True)
    net = sharded_run(lambda net: [[net.blocks[0], net.blocks[2]]], dp_mesh(), 2, net_kwargs=dict(twice=True))
    assert_trained_as(net, reference)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_modules_of_a_list(use_reentrant):
    reference = trained_reference(2, checkpointed=use_reentrant)
    plain = sharded_run(lambda net: [[net.blocks[0], net.blocks[2]]], dp_mesh(), 2)
    net = sharded_run(lambda net: [[net.blocks[0], net.blocks[2]]], dp_mesh(), 2,
                      net_kwargs=dict(checkpointed=use_reentrant))
    assert_trained_as(net, reference)
    for p, q in zip(net.parameters(), plain.parameters()):
        assert torch.equal(p.detach(), q.detach())


def test_hsdp_with_accumulation_on_a_replicate_by_shard_mesh():
    if dist.get_world_size() != 4:
        pytest.skip("a 2 x 2 (replicate, shard) mesh needs 4 ranks")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    reference = trained_reference(2)
    net = Net()
    shard(net, [[net.norm, net.head]], mesh, comm_fusion=True)
    comm.reset_collective_counts()
    train(net, 2, replicas=4, replica=dist.get_rank(), micro_batches=3)
    assert_trained_as(net, reference)
    # Only the last micro-batch of each step reduces: three blocks and the list.
    assert comm.collective_count("reduce_scatter") == comm.collective_count("all_reduce") == 2 * 4


def test_state_dict_and_loading_whole_tensors_through_either_module():
    net = Net()
    shard(net, [[net.norm, net.head]], dp_mesh())
    whole = {k: v.clone() for k, v in Net().state_dict().items()}
    assert set(net.state_dict()) == set(whole)
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
    net.load_state_dict({k: v * 2 for k, v in whole.items()})
    for name, p in net.named_parameters():
        assert torch.equal(full_tensor(p), whole[name] * 2), name
    net.head.load_state_dict({"weight": whole["head.weight"], "bias": whole["head.bias"]})
    assert torch.equal(full_tensor(net.head.weight), whole["head.weight"])


def test_methods_of_either_module_act_on_the_group():
    """unshard and reshard through either module; set_reduce_op_type("sum") on the head sums the
    list's group over the ranks (the reference's gradient, ws times), and leaves the blocks'."""
    ws, r = dist.get_world_size(), dist.get_rank()
    net, reference = Net(), Net()
    shard(net, [[net.norm, net.head]], dp_mesh())
    net.norm.unshard()
    assert net.head._fsdp_group.is_unsharded
    net.head.reshard()
    assert not net.norm._fsdp_group.is_unsharded
    net.head.set_reduce_op_type("sum")
    net.norm.set_modules_to_forward_prefetch([net.blocks[1]])
    reference(batch(0, ws)).pow(2).mean().backward()
    net(batch(0, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK]).pow(2).mean().backward()
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        factor = 1 if name.startswith("blocks.") else ws
        torch.testing.assert_close(full_tensor(p, p.grad), q.grad * factor, rtol=1e-5, atol=1e-6, msg=name)


def run_with_an_interruption(net, sharded, call_alone):
    """Two steps; between the first's backward and its optimizer step, a forward with grad that
    raises after the first block (caught), or a call of the head on its own."""
    ws, r = dist.get_world_size(), dist.get_rank()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for s in range(2):
        x = batch(s, ws)[r * ROWS_PER_RANK:][:ROWS_PER_RANK] if sharded else batch(s, ws)
        opt.zero_grad()
        (net(x).pow(2).sum() / len(x)).backward()
        if s == 0:
            if call_alone:
                net.head(x)
            else:
                with pytest.raises(RuntimeError, match="interrupted"):
                    net.blocks[1].register_forward_pre_hook(_interrupt_once)
                    net(x)
            opt.step()


def _interrupt_once(module, args):
    module._forward_pre_hooks.popitem()
    raise RuntimeError("interrupted")


@pytest.mark.parametrize("call_alone", [False, True])
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("listed", [True, False])
def test_a_pass_left_unfinished_before_an_optimizer_step_is_not_read_after_it(call_alone, reshard, listed):
    """A group's pass where some modules ran and others did not (the forward raised in between,
    or the head was called alone; the head and the first block in a list, or the head and the
    norm in the root's group), then an optimizer step: the next forward gathers the stepped
    shards."""
    reference, net = Net(), Net()
    run_with_an_interruption(reference, False, call_alone)
    shard(net, [[net.blocks[0], net.head]] if listed else [], dp_mesh(), reshard_after_forward=reshard)
    run_with_an_interruption(net, True, call_alone)
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(full_tensor(p, p.grad), q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_call_that_fails_leaves_its_modules_as_they_were():
    net = Net()
    with pytest.raises(TypeError, match="expected a DeviceMesh"):
        fully_shard([net.norm, net.head], mesh="dp")
    assert not isinstance(net.norm, FSDPModule) and not isinstance(net.head, FSDPModule)
    net.head.double()
    with pytest.raises(ValueError, match="expected one dtype for a group's parameters"):
        fully_shard([net.norm, net.head], mesh=dp_mesh())
    assert not isinstance(net.norm, FSDPModule) and not isinstance(net.head, FSDPModule)
    net.head.float()
    fully_shard([net.norm, net.head], mesh=dp_mesh())
    assert net.norm._fsdp_group is net.head._fsdp_group


def test_a_module_below_another_of_the_list_may_be_sharded_already():
    net = Net()
    fully_shard(net.blocks[0].up, mesh=dp_mesh())
    fully_shard([net.blocks[0].up, net.blocks[0]], mesh=dp_mesh())
    assert net.blocks[0]._fsdp_group is not net.blocks[0].up._fsdp_group
    assert len(net.blocks[0]._fsdp_group.parameters) == 2  # down's


@pytest.mark.parametrize("modules, message", [
    ([], "expected an nn.Module or a non-empty list of them, got an empty list"),
    ((nn.Linear(2, 2),), "expected an nn.Module or a non-empty list of them, got tuple"),
    ([nn.Linear(2, 2), "head"], "expected an nn.Module or a list of them, got str at index 1 of the list"),
])
def test_what_is_not_a_list_of_modules_is_a_clear_error(modules, message):
    with pytest.raises(ValueError, match=message):
        fully_shard(modules, mesh=dp_mesh())


def test_a_list_with_a_sharded_module_changes_nothing_and_says_which():
    net = Net()
    fully_shard(net.head, mesh=dp_mesh())
    with pytest.raises(ValueError, match="expected a module fully_shard was not applied to, got FSDPLinear at "
                                         "index 1 of the list"):
        fully_shard([net.norm, net.head], mesh=dp_mesh())
    assert not isinstance(net.norm, FSDPModule)


def test_a_module_listed_with_one_inside_it_is_one_module():
    net = Net()
    fully_shard([net.blocks[0].up, net.blocks[0], net.blocks[0]], mesh=dp_mesh())
    assert isinstance(net.blocks[0], FSDPModule) and not isinstance(net.blocks[0].up, FSDPModule)
    names = [n for n, _ in net.blocks[0].named_parameters()]
    assert net.blocks[0]._fsdp_group.parameters == [dict(net.blocks[0].named_parameters())[n] for n in names]
