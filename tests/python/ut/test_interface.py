"""The original system's public interface on one rank: every name at its import path, the mc2
module's helpers, torch process groups, PyTorch-shaped styles (tuples, a public apply, the kind
checked first) and placements that compare with anything."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hyper_parallel
from hyper_parallel import DTensor, init_device_mesh, parallelize_module
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard, as_python
from hyper_parallel.core.tensor_parallel import (
    ColwiseParallel,
    MC2ColwiseParallel,
    MC2RowwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from hyper_parallel.core.tensor_parallel import mc2


@pytest.fixture(scope="module")
def mesh():
    return init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))


def test_every_name_of_the_original_imports_from_its_path():
    assert mc2.__all__ == ["get_hcomm_info", "AllGatherMatmulFunction", "MatmulReduceScatterFunction", "MC2Linear"]
    from hyper_parallel import MC2Linear as top  # noqa: F401
    from hyper_parallel.core.tensor_parallel import MC2Linear as tp_level  # noqa: F401
    from hyper_parallel.core.tensor_parallel.mc2 import (  # noqa: F401
        AllGatherMatmulFunction,
        MatmulReduceScatterFunction,
        _move_dim_to_front,
        _move_front_to_dim,
        _normalize_sequence_dim,
        get_hcomm_info,
    )

    from hyper_parallel.core.fully_shard.api import HSDPModule, fully_shard  # noqa: F401
    from hyper_parallel.core.fully_shard.utils import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
    from hyper_parallel.core.dtensor import CommDebugMode  # noqa: F401
    from hyper_parallel.core.dtensor.debug import CommDebugMode as debug_level  # noqa: F401
    from hyper_parallel.core.tensor_parallel.style import PrepareModuleInputOutput  # noqa: F401
    from hyper_parallel.platform.torch.fully_shard.utils import MixedPrecisionPolicy as platform_policy

    assert MixedPrecisionPolicy is platform_policy is hyper_parallel.MixedPrecisionPolicy
    assert issubclass(CPUOffloadPolicy, OffloadPolicy)
    assert top is tp_level is mc2.MC2Linear
    assert CommDebugMode is debug_level
    assert "MC2Linear" in hyper_parallel.__all__
    assert "MC2Linear" in hyper_parallel.core.tensor_parallel.__all__
    assert issubclass(AllGatherMatmulFunction, torch.autograd.Function)
    assert issubclass(MatmulReduceScatterFunction, torch.autograd.Function)


def test_normalize_sequence_dim_counts_negative_dims_from_the_end_of_the_leading_dims():
    assert mc2._normalize_sequence_dim(1, 2) == 1
    assert mc2._normalize_sequence_dim(-1, 2) == 1
    assert mc2._normalize_sequence_dim(-2, 2) == 0
    with pytest.raises(RuntimeError, match=r"MC2Linear sequence_dim=2 is out of range for leading rank 2\."):
        mc2._normalize_sequence_dim(2, 2)
    with pytest.raises(RuntimeError, match=r"MC2Linear sequence_dim=-3 is out of range for leading rank 2\."):
        mc2._normalize_sequence_dim(-3, 2)


def test_moving_a_dim_to_the_front_and_back_is_a_contiguous_permutation():
    t = torch.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)
    front = mc2._move_dim_to_front(t, 2)
    assert front.is_contiguous() and torch.equal(front, t.permute(2, 0, 1, 3))
    back = mc2._move_front_to_dim(front, 2)
    assert back.is_contiguous() and torch.equal(back, t)
    assert torch.equal(mc2._move_dim_to_front(t, 0), t)


def test_configure_mc2_takes_a_torch_group_with_the_original_signature(mesh):
    linear = mc2.MC2Linear.from_linear(nn.Linear(16, 16))
    group = mesh.get_group()
    assert isinstance(group, dist.ProcessGroup)
    linear.configure_mc2("all_gather", group, 1, contract=mc2.MC2Contract.relaxed())
    # State read from the C++ core; the group is the very object passed in.
    assert (linear.mc2_mode, linear.mc2_world_size, linear.mc2_sequence_dim) == ("all_gather", 1, 0)
    assert linear.mc2_group is group
    with pytest.raises(ValueError, match=r"configure_mc2: expected world_size to equal the group's size \(1\), got 2"):
        linear.configure_mc2("reduce_scatter", group, 2)
    with pytest.raises(ValueError, match="expected mode 'all_gather' or 'reduce_scatter', got 'gather'"):
        linear.configure_mc2("gather", group, 1)
    assert linear.mc2_mode == "all_gather"  # a failed call changes nothing


def test_an_mc2_linear_can_be_constructed_like_a_linear():
    linear = mc2.MC2Linear(16, 8, bias=False)
    assert isinstance(linear, nn.Linear) and linear.weight.shape == (8, 16) and linear.bias is None
    assert not linear.is_configured and linear.mc2_mode is None and linear.mc2_group is None


def test_get_hcomm_info_names_the_core_communicator(mesh):
    assert mc2.get_hcomm_info(dist.group.WORLD) == "world"
    assert mc2.get_hcomm_info(mesh.get_group()) == "world"  # a 1-d mesh over the world runs on it
    with pytest.raises(TypeError, match="expected a torch.distributed ProcessGroup .*, got str"):
        mc2.get_hcomm_info("tp")


def test_mesh_groups_are_torch_groups(mesh):
    group = mesh.get_group()
    assert dist.get_rank(group) == 0 and dist.get_world_size(group) == 1
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    assert torch.equal(t, torch.ones(3))
    mesh2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="expected mesh_dim for the 2-d mesh"):
        mesh2d.get_group()
    assert dist.get_world_size(mesh2d.get_group("tp")) == 1


def test_styles_keep_their_layouts_as_tuples():
    col = ColwiseParallel()
    assert col.input_layouts == (Replicate(),) and col.output_layouts == (Shard(-1),)
    assert col.desired_input_layouts == (Replicate(),) and col.use_local_output is True
    row = RowwiseParallel(output_layouts=Shard(1))
    assert row.input_layouts == (Shard(-1),) and row.output_layouts == (Shard(1),)
    assert row.desired_input_layouts == (Shard(-1),)
    mc2_col = MC2ColwiseParallel(input_layouts=Shard(1))
    assert mc2_col.input_layouts == (Shard(1),) and mc2_col.desired_input_layouts == (Shard(1),)
    assert MC2RowwiseParallel().output_layouts == (Shard(1),)
    assert SequenceParallel(sequence_dim=0).sequence_sharding == (Shard(0),)
    prep = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
    assert prep.input_layouts == (Shard(1), None) and prep.desired_input_layouts == (Replicate(), None)
    out = PrepareModuleOutput(output_layouts=Shard(0), desired_output_layouts=Replicate())
    assert out.output_layouts == (Shard(0),) and out.desired_output_layouts == (Replicate(),)


def test_layout_lists_are_checked_by_the_core():
    with pytest.raises(ValueError, match="expected input_layouts and desired_input_layouts of the same length"):
        PrepareModuleInput(input_layouts=(Shard(1), Shard(0)), desired_input_layouts=(Replicate(),))
    with pytest.raises(ValueError, match=r"expected output_layouts\[0\] and desired_output_layouts\[0\] both set"):
        PrepareModuleOutput(output_layouts=(Shard(0),), desired_output_layouts=(None,))
    with pytest.raises(ValueError, match=r"RowwiseParallel: expected output_layouts Shard or Replicate, got Partial"):
        RowwiseParallel(output_layouts=Partial())


def test_apply_is_public_and_parallelize_module_calls_it(mesh):
    class Recording(ColwiseParallel):
        applied = []

        def apply(self, module, device_mesh):
            Recording.applied.append(type(module).__name__)
            return super().apply(module, device_mesh)

    linear = nn.Linear(4, 4)
    assert ColwiseParallel().apply(linear, mesh) is linear
    parallelize_module(nn.Sequential(nn.Linear(4, 4)), mesh, {"0": Recording()})
    assert Recording.applied == ["Linear"]


@pytest.mark.parametrize("style, module, error, message", [
    (MC2ColwiseParallel, lambda: nn.Embedding(64, 512), NotImplementedError,
     "MC2ColwiseParallel does not support Embedding"),
    (MC2RowwiseParallel, lambda: nn.Embedding(64, 512), NotImplementedError,
     "MC2RowwiseParallel does not support Embedding"),
    (MC2ColwiseParallel, lambda: nn.ReLU(), TypeError, "MC2ColwiseParallel: expected torch.nn.Linear, got ReLU"),
    (ColwiseParallel, lambda: nn.ReLU(), TypeError,
     "ColwiseParallel: expected torch.nn.Linear or torch.nn.Embedding, got ReLU"),
    (RowwiseParallel, lambda: nn.LayerNorm(4), TypeError,
     "RowwiseParallel: expected torch.nn.Linear or torch.nn.Embedding"),
])
def test_the_module_kind_is_checked_before_the_mesh_is_touched(style, module, error, message):
    target = module()
    with pytest.raises(error, match=message):
        style().apply(target, "not a mesh")
    assert not hasattr(target, "_hp_sharding_style")


def test_a_second_style_on_one_module_is_refused(mesh):
    linear = nn.Linear(4, 4)
    ColwiseParallel().apply(linear, mesh)
    with pytest.raises(ValueError, match="RowwiseParallel: expected a module no style has parallelized yet, got "
                                         "Linear already parallelized by ColwiseParallel"):
        RowwiseParallel().apply(linear, mesh)


def test_a_style_after_fully_shard_is_refused_before_any_parameter_changes():
    # fully_shard lays out the parameters first; a style would shard its shards. Styles go first.
    dp_tp = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    linear = nn.Linear(12, 24)
    hyper_parallel.fully_shard(linear, mesh=dp_tp["dp"])
    weight = linear.weight.detach().clone()
    with pytest.raises(ValueError, match="ColwiseParallel: expected a module no style has parallelized yet, got "
                                         r"FSDPLinear whose parameter 'weight' is already laid out \(by another "
                                         r"style, or by fully_shard: apply styles first\)"):
        ColwiseParallel().apply(linear, dp_tp["tp"])
    assert not hasattr(linear, "_hp_sharding_style")
    assert torch.equal(linear.weight.detach(), weight)


def test_placements_compare_with_anything():
    assert (Shard(1) == None) is False  # noqa: E711
    assert Shard(1) != None  # noqa: E711
    assert Shard(1) in [None, Shard(1)]
    assert Replicate() not in [None, Shard(0), "Replicate()"]
    assert Shard(1) == Shard(1) and hash(Shard(1)) == hash(Shard(1))


def test_partial_spells_its_reduce_op_as_torch(mesh):
    """torch's Partial.reduce_op is a string: code compares it with "sum"."""
    assert Partial().reduce_op == "sum" and Partial("avg").reduce_op == "avg"
    assert as_python(Partial()).reduce_op == "sum" and as_python(Partial("avg")).reduce_op == "avg"
    assert Partial("avg") == Partial("avg") and Partial() != Partial("avg")
    placed = DTensor.from_local(torch.ones(2), mesh, [Partial("avg")])
    assert placed.placements[0].reduce_op == "avg" and repr(placed.placements[0]) == "Partial(avg)"


def test_plan_matching_warns_through_the_core(mesh):
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.warns(UserWarning, match="plan key 'nothing' .* matched no submodule of Sequential"):
        parallelize_module(model, mesh, {"nothing": ColwiseParallel()})
    with pytest.warns(UserWarning, match="the plan is empty"):
        parallelize_module(model, mesh, {})
    with pytest.raises(ValueError, match="expected plan key tokens separated by single dots, got 'a..b'"):
        parallelize_module(model, mesh, {"a..b": ColwiseParallel()})


def test_the_originals_top_level_dtensor_names():
    from hyper_parallel import DeviceMesh, DTensor, get_current_mesh, init_device_mesh  # noqa: F401
    from hyper_parallel.core.dtensor import DTensor as inner, get_current_mesh as inner_current

    assert DTensor is inner and get_current_mesh is inner_current
    assert {"DTensor", "DeviceMesh", "get_current_mesh", "init_device_mesh"} <= set(hyper_parallel.__all__)
