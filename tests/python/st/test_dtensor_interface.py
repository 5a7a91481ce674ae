"""DTensor and DeviceMesh as code written for torch's and the original's calls them, on 2 and 4
ranks: redistribute(device_mesh, placements), layout names, DeviceMesh(device_type, mesh), the
current mesh, the tensor-like reads and conversions, and the factories; each against the full
tensor every rank holds."""

import os

import pytest
import torch
import torch.distributed as dist

from hyper_parallel import parallelize_module
from hyper_parallel.core.dtensor import (
    CommDebugMode,
    DeviceMesh,
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    full,
    get_current_mesh,
    init_device_mesh,
    ones,
    zeros,
)
from hyper_parallel.core.tensor_parallel import ColwiseParallel, RowwiseParallel

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
pytestmark = pytest.mark.skipif(WORLD < 2, reason="needs 2 or more ranks")
square = pytest.mark.skipif(WORLD != 4, reason="needs a 2 x 2 mesh")


@pytest.fixture(scope="module")
def mesh():
    return init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))


@pytest.fixture(scope="module")
def mesh2d():
    return init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp", "tp"))


def chunk_rows(rows):
    """This rank's rows of torch.chunk over the ranks (none where torch.chunk makes fewer)."""
    sizes = [c.numel() for c in torch.empty(rows).chunk(WORLD)]
    return (sizes + [0] * WORLD)[dist.get_rank()]


def whole(*shape, seed=0):
    torch.manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64)


def test_redistribute_takes_the_mesh_first_as_torch_and_the_original(mesh):
    x = whole(2 * WORLD + 1, 3)  # uneven shards
    d = distribute_tensor(x, mesh, [Shard(0)])
    for moved in (d.redistribute(mesh, [Replicate()]), d.redistribute([Replicate()]),
                  d.redistribute(device_mesh=mesh, placements=(Replicate(),)),
                  d.redistribute(placements=[Replicate()])):
        assert moved.placements == (Replicate(),)
        torch.testing.assert_close(moved.to_local(), x, rtol=0, atol=0)
    with pytest.raises(ValueError, match="expected placements, got None"):
        d.redistribute(mesh)
    with pytest.raises(TypeError, match=r"expected \(device_mesh, placements\)"):
        d.redistribute([Replicate()], [Replicate()])


def test_redistribute_through_the_new_spelling_is_differentiable(mesh):
    x = whole(2 * WORLD, 3)
    local = x.chunk(WORLD)[dist.get_rank()].clone().requires_grad_()
    weight = whole(2 * WORLD, 3, seed=1)
    d = DTensor.from_local(local, mesh, [Shard(0)])
    (d.redistribute(mesh, [Replicate()]).to_local() * weight).sum().backward()
    # A Replicate gradient is the same on every rank (torch's reading): each shard takes its rows.
    torch.testing.assert_close(local.grad, weight.chunk(WORLD)[dist.get_rank()])


def test_torchs_keywords_are_taken(mesh):
    """from_local(local_tensor=...), redistribute(..., async_op=...) and full_tensor(grad_placements=...):
    torch's spellings; the last is torch's redistribute to Replicate, then to_local with those
    placements for the gradient."""
    x = whole(2 * WORLD, 3)
    local = x.chunk(WORLD)[dist.get_rank()].clone().requires_grad_()
    weight = whole(2 * WORLD, 3, seed=1)
    d = DTensor.from_local(local_tensor=local, device_mesh=mesh, placements=[Shard(0)])
    for async_op in (True, False):
        moved = d.redistribute(mesh, [Replicate()], async_op=async_op)
        torch.testing.assert_close(moved.to_local(), x, rtol=0, atol=0)
    full = d.full_tensor(grad_placements=[Partial()])
    torch.testing.assert_close(full, x, rtol=0, atol=0)
    # Each rank's gradient is a partial sum: the shard's gradient is the sum of the ranks' rows.
    (full * weight * (dist.get_rank() + 1)).sum().backward()
    ranks_sum = WORLD * (WORLD + 1) / 2
    torch.testing.assert_close(local.grad, weight.chunk(WORLD)[dist.get_rank()] * ranks_sum)


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _Raises(torch.nn.Module):
    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh

    def forward(self, d):
        d.redistribute(self.mesh, [Replicate()])
        raise ValueError("stop")


def test_comm_debug_mode_counts_the_blocks_collectives_by_kind_and_module(mesh, tmp_path):
    """torch's and the original's CommDebugMode: the collectives of the block, and with a module,
    those of each submodule's forward, its parameters and their layouts."""
    d = distribute_tensor(whole(2 * WORLD + 1, 3), mesh, [Shard(0)])
    with CommDebugMode() as mode:
        d.redistribute(mesh, [Replicate()])
        assert mode.get_comm_counts() == {"all_gather": 1}  # so far
        d.redistribute(mesh, [Replicate()]).redistribute(mesh, [Shard(1)])
    assert mode.get_comm_counts() == {"all_gather": 2} and mode.get_total_counts() == 2
    d.redistribute(mesh, [Replicate()])  # after the block: not counted
    assert mode.get_total_counts() == 2
    net = parallelize_module(_Mlp(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = whole(2, 8).float().requires_grad_()
    with CommDebugMode(module=net) as mode:
        net(x).sum().backward()  # down's output all-reduce; up's input gradient all-reduce
    assert mode.get_comm_counts() == {"all_reduce": 2}
    table = mode.generate_comm_debug_tracing_table(noise_level=1).splitlines()
    assert [line.split() for line in table[2:]] == [["(block)", "all_reduce", "x2"], ["(root)", "all_reduce", "x1"],
                                                    ["down", "all_reduce", "x1"]]
    assert "up" in mode.generate_comm_debug_tracing_table(noise_level=2)
    assert mode.get_sharding_info() == {"up.weight": (Shard(0),), "up.bias": (Shard(0),),
                                        "down.weight": (Shard(1),), "down.bias": (Replicate(),)}
    params = {k: sorted(v) for k, v in mode.get_parameter_info().items()}
    assert params == {"up": ["bias", "weight"], "down": ["bias", "weight"]}
    with mode:
        with pytest.raises(RuntimeError, match="expected a block not already open on this instance"):
            with mode:
                pass
    # A forward that raises out of the block is closed with it, credited with its collectives.
    raising = _Raises(mesh)
    with pytest.raises(ValueError, match="stop"):
        with CommDebugMode(module=raising) as raised:
            raising(d)
    assert raised.generate_comm_debug_tracing_table().splitlines()[3].split() == ["(root)", "all_gather", "x1"]
    mode.log_comm_debug_tracing_table_to_file(str(tmp_path / f"table{dist.get_rank()}.txt"))
    mode.generate_json_dump(str(tmp_path / f"dump{dist.get_rank()}.json"))
    assert (tmp_path / f"table{dist.get_rank()}.txt").read_text().startswith("Where")


def test_another_mesh_is_not_supported(mesh, mesh2d):
    d = distribute_tensor(whole(4, 4), mesh, [Shard(0)])
    with pytest.raises(NotImplementedError, match="moving to another mesh is not supported"):
        d.redistribute(mesh2d, [Replicate(), Replicate()])


@square
@pytest.mark.parametrize("names, placements", [
    (("dp", "None"), [Shard(0), Replicate()]),
    (("None", "tp"), [Replicate(), Shard(1)]),
    (("tp", "dp"), [Shard(1), Shard(0)]),
    ((("dp", "tp"), "None"), [Shard(0), Shard(0)]),
    (("None", "None"), [Replicate(), Replicate()]),
])
def test_layout_names_are_the_placements_they_spell(mesh2d, names, placements):
    x = whole(5, 6)
    by_name = distribute_tensor(x, mesh2d, names)
    by_placement = distribute_tensor(x, mesh2d, placements)
    assert by_name.placements == tuple(placements)
    torch.testing.assert_close(by_name.to_local(), by_placement.to_local(), rtol=0, atol=0)
    torch.testing.assert_close(DTensor.from_local(by_name.to_local(), mesh2d, names, shape=[5, 6]).full_tensor(), x)
    torch.testing.assert_close(by_placement.redistribute(mesh2d, names).to_local(), by_name.to_local())


@square
@pytest.mark.parametrize("names, error, message", [
    ((("tp", "dp"), "None"), NotImplementedError, "in mesh-dim order"),
    (("dp", "dp"), ValueError, "each mesh dim named once"),
    (("dp",), ValueError, r"one layout name per tensor dim \(2\), got 1"),
    (("pp", "None"), ValueError, "expected names of mesh dims"),
])
def test_wrong_layout_names_are_named(mesh2d, names, error, message):
    with pytest.raises(error, match=message):
        distribute_tensor(whole(4, 4), mesh2d, names)


def test_placements_are_checked_for_their_kind(mesh):
    with pytest.raises(TypeError, match="expected placements"):
        distribute_tensor(whole(4, 4), mesh, [0])
    with pytest.raises(TypeError, match="as a list or tuple"):
        distribute_tensor(whole(4, 4), mesh, Shard(0))


def same_layout(a, b):
    return (a.mesh_shape, a.rank_list, a.mesh_dim_names, a.get_coordinate()) == \
        (b.mesh_shape, b.rank_list, b.mesh_dim_names, b.get_coordinate())


def test_a_device_mesh_made_from_its_ranks_lays_them_out_as_init_device_mesh(mesh, mesh2d):
    """Meshes made apart have groups of their own, so they are not equal (==): their layouts are."""
    assert same_layout(DeviceMesh("cpu", list(range(WORLD)), mesh_dim_names=("tp",)), mesh)
    assert same_layout(DeviceMesh("cpu", mesh_dim_names=("tp",)), mesh)
    grid = torch.arange(WORLD).view(2, WORLD // 2)
    made = DeviceMesh("cpu", grid, mesh_dim_names=("dp", "tp"))
    assert same_layout(made, mesh2d) and made == made["dp", "tp"] and made != mesh2d
    assert made.mesh_shape == (2, WORLD // 2) and made.rank_list == tuple(range(WORLD))
    assert torch.equal(made.mesh, grid) and made.get_rank() == dist.get_rank()
    x = whole(2, 2 * WORLD)
    d = distribute_tensor(x, made, ["None", "tp"])
    torch.testing.assert_close(d.full_tensor(), x, rtol=0, atol=0)


@square
def test_a_transposed_mesh_lays_shards_out_by_its_coordinates():
    made = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("dp", "tp"))
    r = dist.get_rank()
    assert made.get_coordinate() == [r % 2, r // 2]
    x = whole(8, 2)
    d = distribute_tensor(x, made, [Replicate(), Shard(0)])
    torch.testing.assert_close(d.to_local(), x.chunk(2)[r // 2], rtol=0, atol=0)
    torch.testing.assert_close(d.full_tensor(), x, rtol=0, atol=0)


@pytest.mark.parametrize("grid", ["reversed", "second row", "first row"])
def test_a_mesh_torch_would_reorder_is_refused_on_every_rank(grid):
    if grid != "reversed" and WORLD != 4:
        pytest.skip("a 2 x 2 mesh needs 4 ranks")
    ranks = {"reversed": list(reversed(range(WORLD))), "second row": [[0, 1], [3, 2]],
             "first row": [[1, 0], [2, 3]]}[grid]
    with pytest.raises(ValueError, match="expected each line of ranks along a mesh dim in ascending order"):
        DeviceMesh("cpu", ranks)
    dist.barrier()  # every rank got here: none waits in a group the others never made


def test_wrong_meshes_are_named():
    with pytest.raises(ValueError, match="expected each rank once"):
        DeviceMesh("cpu", [0] * WORLD)
    with pytest.raises(ValueError, match="expected ranks in"):
        DeviceMesh("cpu", list(range(1, WORLD + 1)))
    with pytest.raises(TypeError, match="integer ranks"):
        DeviceMesh("cpu", [0.0, 1.0])
    with pytest.raises(ValueError, match="not supported by this build"):
        DeviceMesh("npu", list(range(WORLD)))


def test_a_mesh_over_some_ranks_has_no_coordinate_elsewhere():
    part = DeviceMesh("cpu", [0, 1], mesh_dim_names=("x",))
    r = dist.get_rank()
    if r < 2:
        assert part.get_coordinate() == [r]
        x = whole(4, 2)
        torch.testing.assert_close(distribute_tensor(x, part, [Shard(0)]).full_tensor(), x)
    else:
        assert part.get_coordinate() is None


def test_with_mesh_makes_it_current_and_nests(mesh, mesh2d):
    with pytest.raises(ValueError, match="expected a mesh entered"):
        get_current_mesh()
    x = whole(2 * WORLD, 2)
    with mesh:
        assert get_current_mesh() == mesh
        with mesh2d:
            assert get_current_mesh() == mesh2d
        d = distribute_tensor(x, placements=[Shard(0)])
        assert d.device_mesh == mesh
        replicated = DTensor.from_local(x)
        assert replicated.placements == (Replicate(),)
    with pytest.raises(ValueError, match="expected a mesh entered"):
        get_current_mesh()
    torch.testing.assert_close(d.full_tensor(), x)


def test_reads_and_conversions_keep_the_layout(mesh):
    x = whole(2 * WORLD + 1, 3)
    d = distribute_tensor(x, mesh, [Shard(0)])
    assert d.shape == torch.Size([2 * WORLD + 1, 3]) and d.size() == x.size() and d.size(0) == 2 * WORLD + 1
    assert d.numel() == x.numel() and d.ndim == 2 and d.dim() == 2
    assert d.dtype == torch.float64 and d.device == x.device and not d.requires_grad
    assert d.local_shape == torch.Size([chunk_rows(2 * WORLD + 1), 3])
    assert isinstance(d.placements[0], Shard) and d.placements[0].dim == 0
    as_float = d.float()
    assert as_float.dtype == torch.float32 and as_float.placements == d.placements
    torch.testing.assert_close(as_float.full_tensor(), x.float())
    torch.testing.assert_close(d.to(torch.bfloat16).to(torch.float64).full_tensor(), x.bfloat16().double())


def test_in_place_fills_and_copies(mesh):
    x = whole(2 * WORLD, 3)
    d = distribute_tensor(x, mesh, [Shard(0)])
    target = zeros(2 * WORLD, 3, device_mesh=mesh, placements=[Shard(0)], dtype=torch.float64)
    assert target.copy_(d) is not None
    torch.testing.assert_close(target.full_tensor(), x)
    torch.testing.assert_close(target.fill_(2.5).full_tensor(), torch.full_like(x, 2.5))
    torch.testing.assert_close(target.zero_().full_tensor(), torch.zeros_like(x))
    # Laid out otherwise: moved to the target's placements (a Partial one summed).
    target.copy_(distribute_tensor(x, mesh, [Replicate()]))
    torch.testing.assert_close(target.full_tensor(), x)
    addend = x if dist.get_rank() == 0 else torch.zeros_like(x)
    replicated = zeros(2 * WORLD, 3, device_mesh=mesh, dtype=torch.float64)
    replicated.copy_(DTensor.from_local(addend, mesh, [Partial()]))
    torch.testing.assert_close(replicated.to_local(), x)
    seven = distribute_tensor(torch.tensor([7.0], dtype=torch.float64), mesh, [Replicate()])
    replicated.copy_(seven)
    torch.testing.assert_close(replicated.to_local(), torch.full_like(x, 7.0))
    for partial in (DTensor.from_local(torch.zeros_like(x), mesh, [Partial()]),  # one rank keeps the value
                    DTensor.from_local(torch.zeros(1, dtype=torch.float64), mesh, [Partial()])):
        partial.copy_(seven)
        torch.testing.assert_close(partial.full_tensor(), torch.full(tuple(partial.shape), 7.0, dtype=torch.float64))
    for wrong in (distribute_tensor(whole(WORLD, 3), mesh, [Shard(0)]),  # rows broadcast locally: not a copy
                  distribute_tensor(torch.arange(float(WORLD), dtype=torch.float64), mesh, [Shard(0)])):
        with pytest.raises(ValueError, match="expected a source of global shape"):
            target.copy_(wrong)


def test_reduce_partial_sums_the_partial_dims(mesh):
    part = whole(3, 2) * (dist.get_rank() + 1)
    d = DTensor.from_local(part, mesh, [Partial()])
    reduced = d.reduce_partial()
    assert reduced.placements == (Replicate(),)
    torch.testing.assert_close(reduced.to_local(), whole(3, 2) * sum(range(1, WORLD + 1)))
    kept = distribute_tensor(whole(3, 2), mesh, [Shard(1)])
    assert kept.reduce_partial().placements == (Shard(1),)


def test_factories_make_only_this_ranks_shard(mesh):
    rows = 2 * WORLD + 1
    expected_rows = chunk_rows(rows)
    for made in (ones(rows, 3, device_mesh=mesh, placements=[Shard(0)]),  # torch's spelling
                 ones((rows, 3), mesh, [Shard(0)])):  # the original's
        assert made.shape == torch.Size([rows, 3]) and made.local_shape == torch.Size([expected_rows, 3])
        torch.testing.assert_close(made.full_tensor(), torch.ones(rows, 3))
    filled = full((rows, 3), 7.0, device_mesh=mesh, placements=[Shard(0)])
    torch.testing.assert_close(filled.full_tensor(), torch.full((rows, 3), 7.0))
    with mesh:
        assert zeros(4, 4).placements == (Replicate(),)
        with pytest.raises(NotImplementedError, match="expected requires_grad False"):
            ones(4, requires_grad=True)


def test_run_check_gives_replicas_coordinate_0s_data_and_checks_the_split(mesh):
    r = dist.get_rank()
    replicated = DTensor.from_local(torch.full((2,), float(r)), mesh, [Replicate()], run_check=True)
    torch.testing.assert_close(replicated.to_local(), torch.zeros(2), rtol=0, atol=0)
    torch.testing.assert_close(replicated.redistribute(mesh, [Shard(0)]).full_tensor(), torch.zeros(2))
    uneven = DTensor.from_local(torch.ones(chunk_rows(2 * WORLD - 1), 3), mesh, [Shard(0)], run_check=True)
    assert uneven.shape == torch.Size([2 * WORLD - 1, 3])
    with pytest.raises(ValueError, match=r"torch.chunk's split of the global shape"):  # on every rank
        DTensor.from_local(torch.ones(r + 1, 3), mesh, [Shard(0)], run_check=True)
    with pytest.raises(ValueError, match=r"expected the shape given \(\[9, 3\]\) to be the one"):
        DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)], run_check=True, shape=[9, 3])


def test_the_remaining_user_errors_are_named(mesh, mesh2d):
    with mesh:
        with pytest.raises(ValueError, match="DeviceMesh::exit: expected the innermost mesh this thread entered"):
            mesh2d.__exit__(None, None, None)
    with pytest.raises(ValueError, match="with none entered"):
        mesh.__exit__(None, None, None)
    d = distribute_tensor(whole(4, 4), mesh, [Replicate()])
    with pytest.raises(ValueError, match="DTensor::copy_: expected a source on this DTensor's mesh"):
        d.copy_(distribute_tensor(whole(4, 4), mesh2d, [Replicate(), Replicate()]))
    with pytest.raises(TypeError, match=r"ones: expected the global size as ints, got \(2.5,\)"):
        ones(2.5, device_mesh=mesh)
    with pytest.raises(TypeError, match="full: expected \\(size, fill_value\\)"):
        full((2, 2), device_mesh=mesh)
    with pytest.raises(NotImplementedError, match="zeros: expected layout torch.strided"):
        zeros(2, device_mesh=mesh, layout=torch.sparse_coo)


def test_get_local_rank_without_mesh_dim_needs_a_1d_mesh():
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    assert mesh["tp"].get_local_rank() == dist.get_rank()
    with pytest.raises(ValueError, match=r"DeviceMesh::get_local_rank: expected mesh_dim for the 2-d mesh"):
        mesh.get_local_rank()
    with pytest.raises(TypeError, match=r"DeviceMesh.__getitem__: expected a mesh dim name or a tuple of them, "
                                        r"got 0 \(a mesh is sliced by its mesh_dim_names\)"):
        mesh[0]
