"""data_parallel for torch.nn modules (2 and 4 ranks): DP over every rank and DP 2 x TP 2 train
like the single-process model over the global batch; runs are bitwise deterministic and the
overlapped path equals the blocking one bitwise; no_sync accumulates; unused parameters keep
no gradient; train.py --dp matches train.py without it; clear errors."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel import (
    ColwiseParallel,
    RowwiseParallel,
    data_parallel,
    init_device_mesh,
    no_sync,
    parallelize_module,
)
from hyper_parallel.core import comm
from hyper_parallel.core.data_parallel import gradient_reducer

LLAMA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "torch", "llama3")
sys.path.insert(0, LLAMA)

import train as trainer  # noqa: E402

GLOBAL_BATCH, DIM, HIDDEN = 8, 16, 32


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.spare = nn.Linear(DIM, DIM)  # never used

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def batch(step, micro=0):
    g = torch.Generator().manual_seed(100 * step + micro + 1)
    return torch.randn(GLOBAL_BATCH, DIM, generator=g), torch.randn(GLOBAL_BATCH, DIM, generator=g)


def loss_of(model, step, replica, replicas, micro=0):
    x, target = batch(step, micro)
    rows = GLOBAL_BATCH // replicas
    return (model(x[replica * rows:][:rows]) - target[replica * rows:][:rows]).pow(2).mean()


def train(model, replica, replicas, steps=3, set_to_none=False):
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        sgd.zero_grad(set_to_none=set_to_none)
        loss_of(model, step, replica, replicas).backward()
        sgd.step()
    return [p.detach().clone() for p in model.parameters()]


def reference():
    torch.manual_seed(7)
    return MLP()


def dp_mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))


def test_data_parallel_trains_like_the_single_process_model():
    mesh = dp_mesh()
    model = data_parallel(reference(), mesh, bucket_cap_mb=1 / 1024)
    params = train(model, mesh.get_local_rank(0), mesh.size(0))
    expected = train(reference(), 0, 1)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-6)
    assert model.spare.weight.grad is None  # no rank used it
    assert len(gradient_reducer(model).bucket_parameters()) > 3


def test_runs_are_bitwise_deterministic_and_overlap_and_bucket_views_equal_blocking():
    mesh = dp_mesh()
    r, p = mesh.get_local_rank(0), mesh.size(0)
    runs = [train(data_parallel(reference(), mesh, bucket_cap_mb=1 / 1024, overlap=overlap,
                                gradient_as_bucket_view=view), r, p, set_to_none=none)
            for overlap, view, none in ((True, False, False), (True, False, False), (False, False, False),
                                        (True, True, False), (True, True, True))]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_no_sync_accumulates_and_the_next_backward_averages_the_sum():
    mesh = dp_mesh()
    r, p = mesh.get_local_rank(0), mesh.size(0)
    model = data_parallel(reference(), mesh)
    comm.reset_collective_counts()
    with no_sync(model):
        loss_of(model, 0, r, p, micro=0).backward()
    assert comm.collective_count("all_reduce") == 0
    loss_of(model, 0, r, p, micro=1).backward()
    assert comm.collective_count("all_reduce") == len(gradient_reducer(model).bucket_parameters())
    ref = reference()
    for q in range(p):  # the average over replicas of both micro-batches' gradients
        loss_of(ref, 0, q, p, micro=0).backward()
        loss_of(ref, 0, q, p, micro=1).backward()
    for got, want in zip(model.parameters(), ref.parameters()):
        if want.grad is None:
            assert got.grad is None
        else:
            torch.testing.assert_close(got.grad, want.grad / p, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) != 4, reason="runs on 4 ranks (2 x 2 mesh)")
def test_data_times_tensor_parallel_trains_like_the_single_process_model():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = reference()
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    data_parallel(model, mesh["dp"], bucket_cap_mb=1 / 1024)
    params = train(model, mesh["dp"].get_local_rank(0), 2)
    expected = train(reference(), 0, 1)
    t, h = mesh["tp"].get_local_rank(0), HIDDEN // 2
    slices = [expected[0][t * h:][:h], expected[1][t * h:][:h], expected[2][:, t * h:][:, :h]] + expected[3:]
    for p, e in zip(params, slices):
        torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-6)


def test_train_py_with_dp_matches_train_py_without():
    args = ["--preset", "debug", "--dtype", "fp32", "--steps", "3", "--batch-size", "4"]
    without = trainer.train(trainer.parse_args(args))
    with_dp = trainer.train(trainer.parse_args(args + ["--dp", "2"]))
    for (s1, l1), (s2, l2) in zip(without, with_dp):
        assert s1 == s2 and l2 == pytest.approx(l1, rel=1e-4)


def test_errors_name_what_was_expected(capsys):
    with pytest.raises(ValueError, match=r"data_parallel: expected a 1-D mesh \(the data-parallel dimension"):
        data_parallel(reference(), init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("a", "b")))
    with pytest.raises(TypeError, match="data_parallel: expected a torch.nn.Module, got list"):
        data_parallel([], dp_mesh())
    with pytest.raises(ValueError, match="expected a module made data-parallel by data_parallel"):
        with no_sync(reference()):
            pass
    with pytest.raises(TypeError, match=r"data_parallel: expected embeddings with dense gradients, got "
                                        r"Embedding\(sparse=True\) at 0 \(its rows already travel row-sparse"):
        data_parallel(nn.Sequential(nn.Embedding(8, DIM, sparse=True)), dp_mesh())
    with pytest.raises(NotImplementedError, match=r"data_parallel: expected trainable embeddings without max_norm, "
                                                  r"got Embedding\(max_norm=2.0\) at 0: .* the replicas diverge"):
        data_parallel(nn.Sequential(nn.Embedding(8, DIM, max_norm=2.0)), dp_mesh())
    model = data_parallel(reference(), dp_mesh())
    with pytest.raises(ValueError, match="data_parallel: expected a module data_parallel has not been applied to"):
        data_parallel(model, dp_mesh())
    with pytest.raises(SystemExit) as exit_info:
        trainer.parse_args(["--dp", "3", "--batch-size", "4"])
    assert exit_info.value.code == 2
    assert "--batch-size (4) must be divisible by --dp (3)" in capsys.readouterr().err


class Embedder(nn.Module):
    """A token embedding and a projection: each replica looks up 3 tokens of its own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.embed = nn.Embedding(64, DIM)
        self.out = nn.Linear(DIM, DIM)

    def loss(self, step, replica):
        ids = (torch.arange(3) * 11 + step + 5 * replica) % 64
        return self.out(self.embed(ids)).pow(2).mean()


def test_embedding_gradients_travel_row_sparse_with_the_dense_bits():
    """An nn.Embedding's gradient is reduced row-sparse (a bucket of its own; only the rows some
    rank looked up travel): bitwise the gradients of a module whose embedding is reduced dense,
    the average of every replica's, with fewer bytes sent."""
    mesh = dp_mesh()
    r, p = mesh.get_local_rank(0), mesh.size(0)
    sparse = data_parallel(Embedder(), mesh)
    assert gradient_reducer(sparse).bucket_parameters()[-1] == [0]  # embed.weight, alone
    dense = Embedder()
    dense_reducer = dense_reducer_over(dense, mesh)
    for step in range(3):
        comm.reset_collective_counts()
        sparse.loss(step, r).backward()
        sparse_bytes = comm.payload_bytes_sent()
        comm.reset_collective_counts()
        dense.loss(step, r).backward()
        dense_bytes = comm.payload_bytes_sent()
        for a, b in zip(sparse.parameters(), dense.parameters()):
            assert torch.equal(a.grad, b.grad)
            a.grad, b.grad = None, None
        assert p == 1 or sparse_bytes < dense_bytes - (p - 1) * 3 * 1024 // p
    del dense_reducer
    reference = Embedder()
    for q in range(p):
        reference.loss(2, q).backward()
    sparse.loss(2, r).backward()
    torch.testing.assert_close(sparse.embed.weight.grad, reference.embed.weight.grad / p, rtol=1e-6, atol=1e-7)


def test_row_sparse_embeddings_false_keeps_the_embedding_dense():
    """row_sparse_embeddings=False: the embedding shares a bucket with the dense parameters and
    the bytes sent are the dense reducer's."""
    mesh = dp_mesh()
    r = mesh.get_local_rank(0)
    module = data_parallel(Embedder(), mesh, row_sparse_embeddings=False)
    dense = Embedder()
    dense_reducer = dense_reducer_over(dense, mesh)
    assert gradient_reducer(module).bucket_parameters() == dense_reducer.bucket_parameters()
    assert len(dense_reducer.bucket_parameters()) == 1
    comm.reset_collective_counts()
    module.loss(0, r).backward()
    module_bytes = comm.payload_bytes_sent()
    comm.reset_collective_counts()
    dense.loss(0, r).backward()
    assert module_bytes == comm.payload_bytes_sent()
    for a, b in zip(module.parameters(), dense.parameters()):
        assert torch.equal(a.grad, b.grad)


def dense_reducer_over(module, mesh):
    """The C++ reducer over `module`'s parameters with no row-sparse ones (every bucket dense)."""
    from hyper_parallel import _C
    return _C.data_parallel(list(module.parameters()), mesh, 25 << 20, True, False, [])


class Normed(nn.Module):
    """An MLP with batch norm: its running statistics are buffers each forward updates."""

    def __init__(self, seed, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(DIM, HIDDEN).to(dtype)
        self.norm = nn.BatchNorm1d(HIDDEN).to(dtype)
        self.fc2 = nn.Linear(HIDDEN, DIM).to(dtype)
        self.norm.running_mean.uniform_()  # apart on every seed, like the weights

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x.to(self.fc1.weight.dtype)))))


def on_every_rank(tensor, mesh):
    """`tensor` as each rank of the mesh holds it (gathered in float32: Gloo)."""
    t = tensor.detach().float().contiguous()
    pieces = [torch.empty_like(t) for _ in range(mesh.size(0))]
    dist.all_gather(pieces, t, group=mesh.get_group(0))
    return pieces


def same_on_every_rank(tensor, mesh):
    pieces = on_every_rank(tensor, mesh)
    return all(torch.equal(pieces[0], q) for q in pieces)


def test_replicas_seeded_apart_start_from_rank_0s_parameters_and_buffers():
    """DDP's broadcast at construction: each rank seeds its own model, and the data-parallel model
    trains like rank 0's in a single process; one broadcast carries every state."""
    mesh = dp_mesh()
    r, p = mesh.get_local_rank(0), mesh.size(0)
    for dtype in (torch.float32, torch.bfloat16):
        comm.reset_collective_counts()
        model = data_parallel(Normed(seed=7 + r, dtype=dtype), mesh, broadcast_buffers=False)
        assert comm.collective_count("broadcast") == (1 if p > 1 else 0)
        assert all(same_on_every_rank(s, mesh) for s in list(model.parameters()) + list(model.buffers()))
        assert torch.equal(model.norm.running_mean, Normed(seed=7, dtype=dtype).norm.running_mean)
    model, expected = data_parallel(Normed(seed=7 + r), mesh, broadcast_buffers=False), Normed(seed=7)
    sgd, ref_sgd = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(expected.parameters(), lr=0.1)
    for step in range(3):
        sgd.zero_grad()
        ref_sgd.zero_grad()
        model.eval()
        expected.eval()  # batch norm on running statistics: the loss is additive over the rows
        loss_of(model, step, r, p).backward()
        loss_of(expected, step, 0, 1).backward()
        sgd.step()
        ref_sgd.step()
    for got, want in zip(model.parameters(), expected.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_buffers_travel_before_a_forward_that_follows_a_training_forward():
    """DDP's broadcast_buffers: after a training forward, each rank's statistics are its batch's;
    the next forward starts from rank 0's. An evaluation forward (no grad) or one in no_sync
    sends nothing before the next."""
    mesh = dp_mesh()
    r, p = mesh.get_local_rank(0), mesh.size(0)
    model = data_parallel(Normed(seed=7), mesh)
    sends = 1 if p > 1 else 0
    comm.reset_collective_counts()
    loss = loss_of(model, 0, r, p)  # the first forward: buffers sent before it
    assert comm.collective_count("broadcast") == sends
    loss.backward()  # (the reducer's first backward broadcasts its bucket order)
    assert same_on_every_rank(model.norm.running_mean, mesh) == (p == 1)  # each rank's own batch since
    rank_0s = on_every_rank(model.norm.running_mean, mesh)[0]
    model.eval()
    with torch.no_grad():
        comm.reset_collective_counts()
        model(batch(1)[0])
        assert comm.collective_count("broadcast") == sends
        assert torch.equal(model.norm.running_mean, rank_0s)
        model(batch(1)[0])  # after an evaluation forward: nothing sent
        assert comm.collective_count("broadcast") == sends
    model.train()
    comm.reset_collective_counts()
    model(batch(2)[0]).sum().backward()  # after evaluation: nothing sent before this one
    with no_sync(model):
        model(batch(3)[0]).sum().backward()  # after training: sent
    model(batch(4)[0]).sum().backward()  # after no_sync: nothing sent
    assert comm.collective_count("broadcast") == sends


def test_init_sync_false_and_broadcast_buffers_false_leave_each_rank_its_state():
    mesh = dp_mesh()
    r, p = mesh.get_local_rank(0), mesh.size(0)
    comm.reset_collective_counts()
    model = data_parallel(Normed(seed=7 + r), mesh, init_sync=False, broadcast_buffers=False)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), Normed(seed=7 + r).state_dict().values()))
    loss_of(model, 0, r, p)
    assert comm.collective_count("broadcast") == 0


def test_replicas_that_differ_in_a_buffer_are_an_error_on_every_rank():
    mesh = dp_mesh()
    r, p = mesh.get_local_rank(0), mesh.size(0)
    model = Normed(seed=7)
    model.register_buffer("steps", torch.zeros(1 + min(r, 1), dtype=torch.int64))
    if p == 1:
        data_parallel(model, mesh)
        return
    with pytest.raises(ValueError, match=r"data_parallel::ReplicaSync: expected buffer steps to be Long\[1\] as on "
                                         r"rank 0, got Long\[2\] on rank 1 \(the replicas must be the same model\)"):
        data_parallel(model, mesh)


def test_parameters_fully_shard_shards_over_the_dp_mesh_are_an_error_and_its_ignored_ones_are_not():
    """fully_shard reduces the gradients of its pieces: averaging them over the ranks holding
    other pieces, or syncing them from rank 0, would mix the rows (rank 1's piece became rank 0's)."""
    from hyper_parallel import fully_shard
    mesh = dp_mesh()
    p = mesh.size(0)
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))
    fully_shard(model, mesh=mesh, ignored_params={model[1].weight, model[1].bias})
    pieces = [q.detach().clone() for q in model[0].parameters()]
    if p > 1:
        with pytest.raises(ValueError, match=rf"data_parallel: expected parameters replicated over the data-parallel "
                                             rf"group, got parameter 0.weight sharded over {p} of its ranks \(mesh "
                                             rf"dim 0 of .*, e.g. by fully_shard, which reduces its gradient itself\)"):
            data_parallel(model, mesh)
    data_parallel(model[1], mesh)  # the parameters fully_shard leaves out
    assert all(torch.equal(a, b) for a, b in zip(pieces, model[0].parameters()))


def test_a_reentrant_checkpoint_is_named_in_the_error():
    """torch 1.13's default checkpoint runs an inner backward the outer graph does not show: the
    reducer took its parameters for unused. The error says so, not "a second gradient"."""
    from torch.utils.checkpoint import checkpoint

    mesh = dp_mesh()
    r, p = mesh.get_local_rank(0), mesh.size(0)
    model = data_parallel(reference(), mesh, bucket_cap_mb=1 / 8192)  # every parameter a bucket
    x, _ = batch(0)
    x = x[r::p].clone().requires_grad_()  # (reentrant checkpointing needs an input that does)
    loss = model.fc2(checkpoint(lambda t: torch.relu(model.fc1(t)), x)).pow(2).mean()
    with pytest.raises(ValueError, match=r"got a gradient the graph did not show when the backward began \(a "
                                         r"reentrant torch.utils.checkpoint's inner backward: pass "
                                         r"use_reentrant=False\) for parameter [01] "):
        loss.backward()


def test_a_backward_with_create_graph_is_an_error_not_a_gradient_without_the_others_part():
    mesh = dp_mesh()
    r, p = mesh.get_local_rank(0), mesh.size(0)
    model = data_parallel(reference(), mesh)
    with pytest.raises(NotImplementedError, match=r"GradientReducer::on_gradient: expected a backward without "
                                                  r"create_graph, got create_graph=True"):
        loss_of(model, 0, r, p).backward(create_graph=True)
    with no_sync(model):  # accumulating only: .grad keeps its graph, as torch's
        loss_of(model, 0, r, p).backward(create_graph=True)
    assert model.fc1.weight.grad.requires_grad
