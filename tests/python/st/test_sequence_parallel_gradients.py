"""The gradients of a sequence-parallel module's parameters, at 2 and 4 ranks against a
single-process reference: the gradient of the module's own forward (each rank's tokens only) is
summed over tp, a loss term on the parameters themselves (which every rank computes alike) is not,
with the penalty before or after the data term and with a gradient hook on the weight (the hook
sees the whole gradient, once); the same with fully_shard over dp on a 2 x 2 mesh; weight_norm
applied before the style; a deep copy of a parallelized model computes with its own parameters and
does not keep the original alive. What would leave a gradient this rank's part only is a clear
error: weight_norm or a parameter added after the style, a double backward."""

import copy
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel import (ColwiseParallel, SequenceParallel, full_tensor, fully_shard, init_device_mesh,
                            parallelize_module)
from hyper_parallel.core.dtensor.placement_types import Shard

BATCH, TOKENS_PER_RANK, DIM, OUT = 2, 3, 8, 6
PENALTY = 0.1


class NormThenColumn(nn.Module):
    """A LayerNorm on the sequence-sharded tokens, then a column layer that gathers them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.norm = nn.LayerNorm(DIM)
        self.proj = nn.Linear(DIM, OUT)
        with torch.no_grad():  # away from their defaults, so a wrong penalty gradient shows
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return self.proj(self.norm(x))


def parallelize(model, tp_mesh):
    return parallelize_module(model, tp_mesh, {"norm": SequenceParallel(),
                                               "proj": ColwiseParallel(input_layouts=Shard(1))})


def penalty(model):
    """Every rank computes it alike over what it holds: the norm's replicated parameters whole."""
    return PENALTY * (model.norm.weight.pow(2).sum() + model.norm.bias.pow(2).sum())


def tokens(tp_size, replicas=1):
    torch.manual_seed(5)
    return torch.randn(replicas, BATCH, tp_size * TOKENS_PER_RANK, DIM)


def my_tokens(x, tp_rank):
    return x.narrow(1, tp_rank * TOKENS_PER_RANK, TOKENS_PER_RANK)


def reference_grads(x, penalty_first=False):
    """The gradients of mean over replicas of the data term, plus the penalty, in one process."""
    ref = NormThenColumn()
    data = sum(ref(x[i]).pow(2).sum() for i in range(x.size(0))) / x.size(0)
    (penalty(ref) + data if penalty_first else data + penalty(ref)).backward()
    return {name: p.grad for name, p in ref.named_parameters()}


def expect_grads(model, expected):
    for name, p in model.named_parameters():
        torch.testing.assert_close(full_tensor(p, p.grad), expected[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("penalty_first", [False, True])
def test_a_loss_term_on_a_sequence_parallel_parameter_is_counted_once(penalty_first):
    ws, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    x = tokens(ws)
    model = parallelize(NormThenColumn(), mesh)
    data = model(my_tokens(x[0], r)).pow(2).sum()
    (penalty(model) + data if penalty_first else data + penalty(model)).backward()
    expect_grads(model, reference_grads(x, penalty_first))


def test_a_hook_on_a_sequence_parallel_weight_sees_its_whole_gradient_once():
    ws, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    x = tokens(ws)
    model = parallelize(NormThenColumn(), mesh)
    seen = []
    model.norm.weight.register_hook(lambda g: seen.append(g.clone()))
    (model(my_tokens(x[0], r)).pow(2).sum() + penalty(model)).backward()
    expected = reference_grads(x)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], expected["norm.weight"], rtol=1e-5, atol=1e-6)
    expect_grads(model, expected)


def test_weight_norm_applied_before_the_style_sums_the_gradients_of_its_parameters():
    ws, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    x = tokens(ws)
    ref, model = NormThenColumn(), NormThenColumn()
    for m in (ref, model):
        nn.utils.weight_norm(m.norm, name="weight", dim=0)
    parallelize(model, mesh)
    ref(x[0]).pow(2).sum().backward()
    model(my_tokens(x[0], r)).pow(2).sum().backward()
    expect_grads(model, {name: p.grad for name, p in ref.named_parameters()})
    assert all(isinstance(p, nn.Parameter) for p in model.norm.parameters())


@pytest.mark.parametrize("change", ["weight_norm", "new_parameter"])
def test_a_parameter_changed_after_the_style_is_an_error_in_a_forward_with_grad(change):
    ws, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    model = parallelize(NormThenColumn(), mesh)
    if change == "weight_norm":
        nn.utils.weight_norm(model.norm, name="weight", dim=0)
    else:
        model.norm.register_parameter("scale", nn.Parameter(torch.ones(DIM)))
    x = my_tokens(tokens(ws)[0], r)
    with torch.no_grad():
        model(x)  # nothing to sum
    with pytest.raises(ValueError, match="expected LayerNorm.s parameters to be those it laid out"):
        model(x)


def test_a_parametrized_module_is_a_clear_error():
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, w):
            return 2 * w

    ws = dist.get_world_size()
    model = NormThenColumn()
    parametrize.register_parametrization(model.norm, "weight", Doubled())
    with pytest.raises(NotImplementedError, match="SequenceParallel: expected a module without parametrizations"):
        parallelize(model, init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",)))


def test_a_norm_inside_a_sharded_module_called_on_its_own_keeps_its_parameters():
    """fully_shard's owner hook must not take the summing node for a replaced parameter."""
    if dist.get_world_size() != 4:
        pytest.skip("a 2 x 2 (dp, tp) mesh needs 4 ranks")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    x = tokens(2, replicas=2)
    model = NormThenColumn()
    model.norm.register_forward_pre_hook(lambda mod, args: None)  # the node is stood in ahead of it
    model = fully_shard(parallelize(model, mesh["tp"]), mesh=mesh["dp"])
    weight = model.norm.weight
    model.norm(my_tokens(x[dp], tp)).sum().backward()  # on its own, outside the root's forward
    assert model.norm._parameters["weight"] is weight and isinstance(weight, nn.Parameter)
    model.zero_grad()
    (model(my_tokens(x[dp], tp)).pow(2).sum() + penalty(model)).backward()
    ref = NormThenColumn()
    (sum(ref(x[i]).pow(2).sum() for i in range(2)) / 2 + penalty(ref)).backward()
    expect_grads(model, {name: p.grad for name, p in ref.named_parameters()})


def test_a_forward_that_raises_leaves_the_parameters_in_place():
    ws = dist.get_world_size()
    model = parallelize(NormThenColumn(), init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",)))
    weight = model.norm.weight
    with pytest.raises(RuntimeError):
        model.norm(torch.randn(2, 3, DIM + 1))
    assert model.norm.weight is weight and model.norm._parameters["weight"] is weight


def test_a_double_backward_through_a_summed_gradient_is_an_error():
    ws, r = dist.get_world_size(), dist.get_rank()
    model = parallelize(NormThenColumn(), init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",)))
    loss = model(my_tokens(tokens(ws)[0], r)).pow(2).sum()
    if ws == 1:
        pytest.skip("nothing is summed on one rank")
    with pytest.raises(NotImplementedError, match="expected a backward without create_graph"):
        torch.autograd.grad(loss, [model.norm.weight], create_graph=True)


def test_create_graph_passes_nodes_that_hand_the_gradient_on_and_stops_at_communication():
    """A row-parallel layer over a sharded input: its output's gradient passes its reduction's node
    unchanged (graph kept), so a first-order gradient with create_graph is computed; a gradient with
    a graph that meets communication (a reduce-scatter's all-gather in backward) would lose it: refused."""
    from hyper_parallel import RowwiseParallel
    ws, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    layer = parallelize_module(nn.Linear(4 * ws, 2, bias=False), mesh, RowwiseParallel(input_layouts=Shard(-1)))
    x = torch.randn(3, 4 * ws).chunk(ws, -1)[r].clone().requires_grad_()
    g, = torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)
    assert g.requires_grad
    torch.testing.assert_close(g.detach(), torch.autograd.grad(layer(x).pow(2).sum(), x)[0])
    if ws > 1:
        style = RowwiseParallel(input_layouts=Shard(0), output_layouts=Shard(0))
        gathered = parallelize_module(nn.Linear(4, 2, bias=False), mesh, style)
        with pytest.raises(NotImplementedError, match="expected a backward without create_graph"):
            torch.autograd.grad(gathered(torch.randn(2 * ws, 4, requires_grad=True)).pow(2).sum(), gathered.weight,
                                create_graph=True)


def test_a_deep_copy_of_a_sequence_parallel_module_computes_with_its_own_parameters():
    ws, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("tp",))
    model = parallelize(NormThenColumn(), mesh)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.norm.weight.mul_(2)
    x = my_tokens(tokens(ws)[0], r)
    assert not torch.equal(twin.norm(x), model.norm(x))
    twin(x).sum().backward()
    assert twin.norm.weight.grad is not None and model.norm.weight.grad is None
    original = weakref.ref(model.norm)
    del model
    gc.collect()
    assert original() is None, "the copy keeps the original model alive"
    twin(x).sum().backward()


@pytest.mark.parametrize("norm_sharded_alone", [False, True])
def test_a_loss_term_on_a_sequence_parallel_parameter_under_fully_shard_on_a_2x2_mesh(norm_sharded_alone):
    if dist.get_world_size() != 4:
        pytest.skip("a 2 x 2 (dp, tp) mesh needs 4 ranks")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    x = tokens(2, replicas=2)
    model = parallelize(NormThenColumn(), mesh["tp"])
    if norm_sharded_alone:
        fully_shard(model.norm, mesh=mesh["dp"])
    model = fully_shard(model, mesh=mesh["dp"])
    for _ in range(2):  # the second backward accumulates
        (model(my_tokens(x[dp], tp)).pow(2).sum() + penalty(model)).backward()
    expect_grads(model, {name: 2 * g for name, g in reference_grads(x).items()})
