"""PrepareModuleInput with torch's whole signature: keyword inputs converted by
input_kwarg_layouts / desired_input_kwarg_layouts (torch 1.13's pre-hooks do not see them), beside
the positional ones or alone; no layouts at all is a style that changes nothing; the errors name
what was expected. PrepareModuleInputOutput, both on one module. Against the single-process
module at 2 and 4 ranks."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel import PrepareModuleInput, PrepareModuleInputOutput, init_device_mesh, parallelize_module
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard

ROWS, DIM = 3, 4


class Masked(nn.Module):
    """Needs its whole input and mask: a sum over the rows."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x, scale=None, *, mask=None):
        y = self.proj(x).cumsum(0)
        if mask is not None:
            y = y * mask
        return y if scale is None else y * scale


@pytest.fixture
def mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))


def rows_of_every_rank(*shape):
    torch.manual_seed(7)
    return torch.randn(dist.get_world_size() * ROWS, *shape)


def mine(t):
    return t.narrow(0, dist.get_rank() * ROWS, ROWS)


@pytest.mark.parametrize("positional", [False, True])
def test_keyword_inputs_are_converted_beside_the_positional_ones(mesh, positional):
    x, mask, scale = rows_of_every_rank(DIM), rows_of_every_rank(DIM), torch.tensor(1.5)
    reference = Masked()
    model = copy.deepcopy(reference)
    layouts = dict(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None)) if positional else {}
    parallelize_module(model, mesh, PrepareModuleInput(**layouts, input_kwarg_layouts={"mask": Shard(0)},
                                                       desired_input_kwarg_layouts={"mask": Replicate()},
                                                       use_local_output=True))
    got = model(mine(x) if positional else x, scale, mask=mine(mask))
    torch.testing.assert_close(got, reference(x, scale, mask=mask))
    torch.testing.assert_close(model(x if not positional else mine(x), scale), reference(x, scale))  # no mask


def test_a_keyword_layout_without_a_desired_one_keeps_the_input(mesh):
    x, mask = rows_of_every_rank(DIM), rows_of_every_rank(DIM)
    reference = Masked()
    model = parallelize_module(copy.deepcopy(reference), mesh,
                               PrepareModuleInput(input_kwarg_layouts={"mask": Replicate()}))
    torch.testing.assert_close(model(x, mask=mask), reference(x, mask=mask))


def test_no_layouts_change_nothing(mesh):
    x = rows_of_every_rank(DIM)
    reference = Masked()
    model = parallelize_module(copy.deepcopy(reference), mesh, PrepareModuleInput())
    torch.testing.assert_close(model(x, 2.0, mask=x), reference(x, 2.0, mask=x))


def test_errors_name_what_was_expected(mesh):
    with pytest.raises(ValueError, match="expected desired_input_layouts with input_layouts"):
        PrepareModuleInput(input_layouts=Shard(0))
    with pytest.raises(ValueError, match="expected desired_input_kwarg_layouts for keyword inputs that "
                                         r"input_kwarg_layouts names \(\['mask'\]\), got 'bias'"):
        PrepareModuleInput(input_kwarg_layouts={"mask": Shard(0)}, desired_input_kwarg_layouts={"bias": Replicate()})
    with pytest.raises(TypeError, match="expected input_kwarg_layouts as a dict of keyword name -> placement"):
        PrepareModuleInput(input_kwarg_layouts=[Shard(0)])
    model = parallelize_module(Masked(), mesh, PrepareModuleInput(input_kwarg_layouts={"mask": Shard(0)},
                                                                  desired_input_kwarg_layouts={"mask": Replicate()}))
    with pytest.raises(TypeError, match="expected a tensor as keyword input 'mask' .* got float"):
        model(torch.ones(ROWS, DIM), mask=2.0)


@pytest.mark.parametrize("use_local_input", [False, True])
def test_prepare_module_input_output_converts_both_sides(mesh, use_local_input):
    """Each rank's rows in, gathered for the module (which needs them all), its rows of the output
    out: the reference's values and gradients."""
    x = rows_of_every_rank(DIM)
    reference = Masked()
    model = parallelize_module(copy.deepcopy(reference), mesh, PrepareModuleInputOutput(
        input_layouts=Shard(0), desired_input_layouts=Replicate(), input_kwarg_layouts={"mask": Shard(0)},
        desired_input_kwarg_layouts={"mask": Replicate()}, use_local_input=use_local_input,
        output_layouts=Replicate(), desired_output_layouts=Shard(0)))
    mask = rows_of_every_rank(DIM).sigmoid()
    expected = reference(x, mask=mask)
    expected.pow(2).sum().backward()
    mine_x = mine(x).requires_grad_()
    got = model(mine_x, mask=mine(mask))
    torch.testing.assert_close(got, mine(expected))
    got.pow(2).sum().backward()
    torch.testing.assert_close(mine_x.grad, mine(torch.autograd.grad(reference(x.requires_grad_(), mask=mask)
                                                                     .pow(2).sum(), x)[0]))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    with pytest.raises(TypeError, match="output_layouts"):
        PrepareModuleInputOutput(input_layouts=Shard(0), desired_input_layouts=Replicate())
