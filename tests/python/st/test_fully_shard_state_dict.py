"""get_model_state_dict / set_model_state_dict (the original's and torch.distributed.checkpoint's)
on fully_shard models (1-d, and inside tensor parallelism on a 2 x 2 (dp, tp) mesh) and on a
tensor-parallel model without fully_shard, against a model without parallelism: whole tensors
bitwise on every rank or on rank 0 only, pieces, frozen parameters left out, tied parameters;
loading whole tensors, pieces, and rank 0's whole tensors broadcast; rank 0's errors raised on
every rank with nothing loaded; option errors; the original's import paths."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel import ColwiseParallel, RowwiseParallel, full_tensor, fully_shard, init_device_mesh
from hyper_parallel import parallelize_module
from hyper_parallel.core import comm
from hyper_parallel.core.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from hyper_parallel.core.fully_shard import StateDictOptions, get_model_state_dict, set_model_state_dict

from fully_shard_models import DIM, Block


class Net(nn.Module):
    def __init__(self, seed=7):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 2)
        self.register_buffer("scale", torch.full((DIM,), 0.5))
        self.register_buffer("mask", torch.rand(DIM) > 0.5)  # a dtype the broadcast sends as bytes

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x * self.scale))


def parallel(layout, seed=7):
    """Net(seed) laid out: "fsdp" (1-d), "tp+fsdp" (2 x 2), or "tp" (tensor parallelism only)."""
    net = Net(seed)
    dp = None
    if layout == "fsdp":
        dp = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    else:
        tp_size = 2 if layout == "tp+fsdp" else dist.get_world_size()
        mesh = init_device_mesh("cpu", (dist.get_world_size() // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
        for b in net.blocks:
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        dp = mesh["dp"] if layout == "tp+fsdp" else None
    if dp is not None:
        for b in net.blocks:
            fully_shard(b, mesh=dp)
        fully_shard(net, mesh=dp)
    return net


LAYOUTS = ["fsdp", "tp+fsdp", "tp"]


def skip_unless_fits(layout):
    if layout == "tp+fsdp" and dist.get_world_size() != 4:
        pytest.skip("a 2 x 2 (dp, tp) mesh needs 4 ranks")


def assert_whole_as(net, reference):
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        assert torch.equal(full_tensor(p), q.detach()), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_full_state_dict_is_the_unparallel_models_bitwise(layout):
    skip_unless_fits(layout)
    reference, net = Net(), parallel(layout)
    comm.reset_collective_counts()
    full = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    assert list(full) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key
    offloaded = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        assert all(torch.equal(offloaded[k], v) for k, v in full.items()) and list(offloaded) == list(full)
    else:
        assert offloaded == {}
    pieces = get_model_state_dict(net)
    assert all(torch.equal(pieces[k], v) for k, v in net.state_dict().items()) and list(pieces) == list(full)


def test_frozen_parameters_are_left_out_on_request_and_tied_ones_kept_under_each_name():
    net = parallel("fsdp")
    net.norm.requires_grad_(False)
    kept = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True))
    assert "norm.weight" not in kept and "norm.bias" not in kept and "head.weight" in kept and "scale" in kept

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(2)
            self.emb, self.head = nn.Embedding(10, DIM), nn.Linear(DIM, 10, bias=False)
            self.head.weight = self.emb.weight

    reference = Tied()
    tied = fully_shard(Tied(), mesh=init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",)))
    full = get_model_state_dict(tied, options=StateDictOptions(full_state_dict=True))
    assert set(full) == {"emb.weight", "head.weight"}
    assert torch.equal(full["head.weight"], reference.emb.weight.detach())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_set_loads_whole_tensors_pieces_and_rank0s_broadcast(layout):
    skip_unless_fits(layout)
    source = Net(seed=11)
    whole = source.state_dict()
    net = parallel(layout)
    set_model_state_dict(net, whole, options=StateDictOptions(full_state_dict=True))
    assert_whole_as(net, source)
    pieces = get_model_state_dict(net)
    net = parallel(layout)
    assert not set_model_state_dict(net, pieces).missing_keys
    assert_whole_as(net, source)
    net = parallel(layout)
    given = whole if dist.get_rank() == 0 else {}
    result = set_model_state_dict(net, given, options=StateDictOptions(full_state_dict=True,
                                                                       broadcast_from_rank0=True))
    assert not result.missing_keys and not result.unexpected_keys
    assert_whole_as(net, source)
    assert torch.equal(net.scale, source.scale) and torch.equal(net.mask, source.mask)
    assert not torch.equal(source.mask, Net().mask)
    # Not strict: the keys rank 0 has load, the others stay.
    net = parallel(layout)
    given = {"head.weight": whole["head.weight"]} if dist.get_rank() == 0 else {}
    set_model_state_dict(net, given, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                              strict=False))
    assert torch.equal(full_tensor(net.head.weight), whole["head.weight"])
    assert torch.equal(full_tensor(net.head.bias), Net().head.bias.detach())


def dtensors_of(whole, how):
    """Each whole tensor as a DTensor laid out otherwise than the parameters: replicated, sharded
    on a 2 x 2 mesh with its dims in the other order, or Partial (rank 0 holds the value)."""
    ws = dist.get_world_size()
    flat = init_device_mesh("cpu", (ws,), mesh_dim_names=("other",))
    if how == "replicate":
        return {k: distribute_tensor(v, flat, [Replicate()]) for k, v in whole.items()}
    if how == "partial":
        return {k: DTensor.from_local(v if dist.get_rank() == 0 else torch.zeros_like(v), flat, [Partial()])
                for k, v in whole.items()}
    square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))["b", "a"]
    return {k: distribute_tensor(v, square, [Shard(0), Replicate()] if v.dim() else [Replicate()] * 2)
            for k, v in whole.items()}


@pytest.mark.parametrize("how", ["replicate", "partial", "transposed mesh"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dtensors_laid_out_otherwise_load_their_whole_values(layout, how):
    """A DTensor's local tensor is the parameter's piece only where its mesh and placements are
    the parameter's: otherwise its whole tensor loads (a Partial one summed)."""
    skip_unless_fits(layout)
    if how == "transposed mesh" and dist.get_world_size() != 4:
        pytest.skip("a 2 x 2 mesh needs 4 ranks")
    source = Net(seed=11)
    params = dict(source.named_parameters())
    values = dtensors_of({k: v.detach() for k, v in params.items()}, how)
    net = parallel(layout)
    assert not set_model_state_dict(net, values, options=StateDictOptions(strict=False)).unexpected_keys
    assert_whole_as(net, source)
    if layout != "tp":  # torch's own load_state_dict: no DTensor values without fully_shard
        net = parallel(layout)
        net.load_state_dict(dict(net.state_dict(), **values))
        assert_whole_as(net, source)


def test_a_dtensor_of_another_whole_shape_is_an_error():
    net = parallel("fsdp")
    flat = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("other",))
    wrong = distribute_tensor(torch.zeros(DIM, 2), flat, [Replicate()])  # head.weight is [2, DIM]
    with pytest.raises(ValueError, match=r"expected head.weight as a DTensor of the whole tensor's shape "
                                         r"\[2, 12\], got one of \[12, 2\]"):
        set_model_state_dict(net, {"head.weight": wrong}, options=StateDictOptions(strict=False))


@pytest.mark.parametrize("change, message", [
    (lambda sd: sd.pop("norm.bias"), "missing key norm.bias"),
    (lambda sd: sd.update({"extra": torch.zeros(1)}), "unexpected key extra"),
    (lambda sd: sd.update({"head.weight": torch.zeros(3, DIM)}),
     r"expected head.weight of the whole tensor's shape \[2, 12\], got \[3, 12\]"),
    (lambda sd: sd.update({"head.bias": 1.0}), "expected head.bias a tensor, got float"),
])
def test_rank0s_problems_are_every_ranks_error_and_nothing_loads(change, message):
    net = parallel("fsdp")
    given = Net(seed=11).state_dict()
    change(given)
    with pytest.raises(ValueError, match="set_model_state_dict: rank 0's state_dict cannot load: .*" + message):
        set_model_state_dict(net, given if dist.get_rank() == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    assert_whole_as(net, Net())


class WithState(nn.Module):
    """A BatchNorm (its num_batches_tracked default depends on the dict's _metadata) and a module
    with an extra state (a non-tensor value)."""

    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.count = 0

        def get_extra_state(self):
            return {"count": self.count}

        def set_extra_state(self, state):
            self.count = state["count"]

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.lin, self.bn, self.counter = nn.Linear(DIM, DIM), nn.BatchNorm1d(DIM), WithState.Counter()


@pytest.mark.parametrize("broadcast", [False, True])
def test_extra_states_metadata_and_unexpected_keys_load_as_torch_loads_them(broadcast):
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=False)
    source = WithState()
    source.counter.count = 5
    source.bn.num_batches_tracked.fill_(9)
    given = source.state_dict()
    del given["bn.num_batches_tracked"]
    given["extra"] = torch.zeros(1)
    net = WithState()
    fully_shard(net, mesh=init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",)))
    net.bn.num_batches_tracked.fill_(4)
    result = set_model_state_dict(net, given if dist.get_rank() == 0 or not broadcast else {}, options=options)
    assert net.counter.count == 5 and torch.equal(full_tensor(net.lin.weight), source.lin.weight.detach())
    assert int(net.bn.num_batches_tracked) == 4  # torch keeps it, as the dict's metadata says the version has it
    assert result.missing_keys == ["bn.num_batches_tracked"] and result.unexpected_keys == ["extra"]


def test_a_value_rank0_cannot_send_is_every_ranks_error_before_anything_moves():
    net = parallel("fsdp")
    given = Net(seed=11).state_dict()
    given["head.weight"] = torch.empty(2, DIM, device="meta")
    with pytest.raises(ValueError, match="expected head.weight a dense tensor with data on cpu, got one on meta"):
        set_model_state_dict(net, given if dist.get_rank() == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    assert_whole_as(net, Net())


def test_a_load_inside_the_forward_is_an_error_also_from_a_module_above():
    holder = nn.ModuleDict({"net": parallel("fsdp")})
    errors = []

    def hook(mod, args, output):
        try:
            holder.load_state_dict({"net." + k: v for k, v in Net(seed=11).state_dict().items()})
        except ValueError as error:
            errors.append(str(error))

    holder.net.blocks[1].register_forward_hook(hook)
    holder.net(torch.randn(3, DIM))
    assert "expected a load into FSDPNet outside its forward and backward" in errors[0]
    assert_whole_as(holder.net, Net())


def test_option_errors():
    net = parallel("fsdp")
    with pytest.raises(ValueError, match="expected full_state_dict=True with broadcast_from_rank0=True"):
        set_model_state_dict(net, {}, options=StateDictOptions(broadcast_from_rank0=True))
    with pytest.raises(ValueError, match=r"get_model_state_dict: expected options.cpu_offload a bool, got 1"):
        get_model_state_dict(net, options=StateDictOptions(cpu_offload=1))
    with pytest.raises(ValueError, match=r"expected a StateDictOptions, got dict without \['full_state_dict'"):
        get_model_state_dict(net, options={"full_state_dict": True})


def test_the_originals_import_paths():
    from hyper_parallel.core.fully_shard.api import get_model_state_dict as from_api
    from hyper_parallel.platform.torch.fully_shard.state_dict_utils import set_model_state_dict as from_platform
    assert from_api is get_model_state_dict and from_platform is set_model_state_dict
