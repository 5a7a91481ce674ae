"""MC2Linear and the MC2 styles on one rank: conversion in place, configuration, layout
validation, the sequence-dim layout, and every fail-closed case with its Python exception type
and message (each raised by the C++ core)."""

import copy

import pytest
import torch
from torch import nn

import hyper_parallel
from hyper_parallel import MC2ColwiseParallel, MC2RowwiseParallel, init_device_mesh
from hyper_parallel import _C
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard
from hyper_parallel.core.tensor_parallel import ColwiseParallel, RowwiseParallel
from hyper_parallel.core.tensor_parallel.mc2 import MC2Contract, MC2Linear


@pytest.fixture(scope="module")
def mesh():
    return init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))


def test_import_paths_match_the_original():
    from hyper_parallel.core.tensor_parallel import MC2ColwiseParallel as A, MC2RowwiseParallel as B  # noqa: F401
    from hyper_parallel.core.tensor_parallel.mc2 import MC2Linear as L  # noqa: F401
    from hyper_parallel.core.dtensor.placement_types import Partial as P, Replicate as R, Shard as S  # noqa: F401

    for name in ("init_device_mesh", "parallelize_module", "ColwiseParallel", "RowwiseParallel",
                 "SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput", "MC2ColwiseParallel",
                 "MC2RowwiseParallel"):
        assert hasattr(hyper_parallel, name), name
    assert issubclass(MC2ColwiseParallel, ColwiseParallel)
    assert issubclass(MC2RowwiseParallel, RowwiseParallel)
    assert isinstance(MC2ColwiseParallel(), ColwiseParallel)


def test_from_linear_keeps_the_object_and_its_parameters():
    linear = nn.Linear(512, 512)
    weight, bias = linear.weight, linear.bias
    values = weight.detach().clone()
    converted = MC2Linear.from_linear(linear)
    assert converted is linear
    assert isinstance(linear, MC2Linear) and isinstance(linear, nn.Linear)
    assert linear.weight is weight and linear.bias is bias
    assert torch.equal(linear.weight, values)
    assert [id(p) for p in linear.parameters()] == [id(weight), id(bias)]
    assert MC2Linear.from_linear(linear) is linear
    assert not linear.is_configured


def test_a_non_linear_is_rejected():
    with pytest.raises(TypeError, match="MC2Linear.from_linear: expected a torch.nn.Linear, got ReLU"):
        MC2Linear.from_linear(nn.ReLU())


def test_configure_mc2_rejects_a_bad_mode_and_sets_the_attributes(mesh):
    linear = MC2Linear.from_linear(nn.Linear(512, 512))
    group = mesh.get_group(0)
    with pytest.raises(ValueError, match="expected mode 'all_gather' or 'reduce_scatter', got 'all_reduce'"):
        linear.configure_mc2("all_reduce", group, 1, 1, contract=MC2Contract.relaxed())
    with pytest.raises(ValueError, match=r"expected world_size to equal the group's size \(1\), got 2"):
        linear.configure_mc2("all_gather", group, 2, 1)
    assert not linear.is_configured
    linear.configure_mc2("reduce_scatter", group, 1, 0, contract=MC2Contract.relaxed())
    assert (linear.mc2_mode, linear.mc2_world_size, linear.mc2_sequence_dim) == ("reduce_scatter", 1, 0)
    assert linear.mc2_group.size() == 1


def test_unconfigured_forward_is_a_plain_linear_as_the_originals():
    """A model written with MC2Linear layers runs without parallelism, any dtype, gradients too."""
    torch.manual_seed(0)
    plain = nn.Linear(16, 8)
    linear = MC2Linear.from_linear(copy.deepcopy(plain))
    x = torch.randn(2, 3, 16, requires_grad=True)
    y = linear(x)
    torch.testing.assert_close(y, plain(x), rtol=0, atol=0)
    y.sum().backward()
    plain(x).sum().backward()
    torch.testing.assert_close(linear.weight.grad, plain.weight.grad, rtol=0, atol=0)
    assert MC2Linear(4, 2)(torch.ones(3, 4)).shape == (3, 2)


def test_styles_validate_their_layouts():
    with pytest.raises(ValueError, match="MC2ColwiseParallel: requires a sharded input layout"):
        MC2ColwiseParallel(input_layouts=Replicate())
    with pytest.raises(ValueError, match="MC2RowwiseParallel: requires a sharded output layout"):
        MC2RowwiseParallel(output_layouts=Replicate())
    with pytest.raises(ValueError, match=r"expected output_layouts Shard or Replicate, got Partial\(sum\)"):
        MC2ColwiseParallel(output_layouts=Partial())
    with pytest.raises(ValueError, match=r"expected input_layouts Shard\(sequence dim\), got Shard\(-1\)"):
        MC2ColwiseParallel(input_layouts=Shard(-1))


def test_apply_yields_a_configured_mc2_linear(mesh):
    relaxed = MC2Contract.relaxed()
    col = hyper_parallel.parallelize_module(nn.Linear(16, 32), mesh, MC2ColwiseParallel(contract=relaxed))
    assert isinstance(col, MC2Linear)
    assert (col.mc2_mode, col.mc2_world_size, col.mc2_sequence_dim) == ("all_gather", 1, 1)
    row = hyper_parallel.parallelize_module(
        nn.Linear(32, 16), mesh, MC2RowwiseParallel(output_layouts=Shard(0), contract=relaxed))
    assert (row.mc2_mode, row.mc2_sequence_dim) == ("reduce_scatter", 0)
    y = row(col(torch.randn(4, 2, 16).transpose(0, 1).contiguous()))  # [S, B, H] after the row layer
    assert y.shape == (2, 4, 16)


def test_sequence_rows_round_trip_and_the_naive_flatten_counterexample():
    x = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    rows = _C.sequence_rows(x, 1)
    assert rows.shape == (6, 4)
    assert torch.equal(_C.from_sequence_rows(rows, x, 1, 3), x)
    full = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)  # [B, S, H]
    shard0, shard1 = full[:, :2], full[:, 2:]
    gathered = torch.cat([_C.sequence_rows(shard0, 1), _C.sequence_rows(shard1, 1)])
    assert torch.equal(_C.from_sequence_rows(gathered, shard0, 1, 4), full)
    naive = torch.cat([shard0.reshape(-1, 3), shard1.reshape(-1, 3)]).reshape(2, 4, 3)
    assert not torch.equal(naive, full)


# (The dtype limit is checked when a layer runs: tests/python/st/test_mc2_interface.py.)
@pytest.mark.parametrize("style, module, error, message", [
    (lambda: MC2ColwiseParallel(contract=MC2Contract.strict()), lambda: nn.Linear(128, 512).bfloat16(), ValueError,
     r"MC2 world_size: expected one of \[2, 4, 8\], got 1"),
    (lambda: MC2ColwiseParallel(), lambda: nn.ReLU(), TypeError,
     "MC2ColwiseParallel: expected torch.nn.Linear, got ReLU; MC2 fuses Linear layers only"),
    (lambda: MC2RowwiseParallel(), lambda: nn.Embedding(64, 512), NotImplementedError,
     "MC2RowwiseParallel does not support Embedding"),
    (lambda: MC2ColwiseParallel(), lambda: nn.Embedding(64, 512), NotImplementedError,
     "MC2ColwiseParallel does not support Embedding"),
])
def test_fail_closed_cases_raise_python_exceptions(mesh, style, module, error, message):
    target = module()
    with pytest.raises(error, match=message):
        hyper_parallel.parallelize_module(target, mesh, style())
    assert not isinstance(target, MC2Linear)


def test_contract_limits_are_value_errors(mesh):
    # The 1-rank mesh is outside the default world sizes; allow it and check each k limit.
    contract_any_world = MC2Contract.relaxed()
    assert contract_any_world.min_k == 1
    strict = MC2Contract.strict()
    assert strict.min_k == 256 and strict.max_k == 65535 and strict.world_sizes == [2, 4, 8]
    assert strict.dtypes == [torch.float16, torch.bfloat16]
    with pytest.raises(ValueError, match=r"where: MC2 k: expected in \[256, 65535\), got 128"):
        strict.check_k("where", "k", 128)
    with pytest.raises(ValueError, match="MC2 dtype"):
        strict.check_dtype("where", torch.float32)


def test_a_non_1d_mesh_is_a_value_error(mesh):
    with pytest.raises(ValueError, match="parallelize_module: expected a 1-d TP mesh, got a 2-d mesh"):
        hyper_parallel.parallelize_module(nn.Linear(4, 4), init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp")),
                                          ColwiseParallel())


def test_options_chunk_the_rows_automatically_unless_given_a_count():
    from hyper_parallel.core.tensor_parallel.mc2 import MC2Options

    assert MC2Options().chunks_per_rank == "auto"
    assert MC2Options("auto").chunks_per_rank == "auto"
    assert MC2Options(4).chunks_per_rank == 4
    assert MC2Options(chunks_per_rank=2, defer_weight_grads=False).defer_weight_grads is False
    with pytest.raises(ValueError, match="expected chunks_per_rank an int >= 1 or 'auto', got 0"):
        MC2Options(0)
    with pytest.raises(ValueError, match="got 'fast'"):
        MC2Options("fast")
    with pytest.raises(TypeError, match="got float"):
        MC2Options(2.0)
    with pytest.raises(TypeError, match="got bool"):
        MC2Options(True)
