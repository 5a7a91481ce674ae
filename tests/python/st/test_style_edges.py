"""The styles where users leave the common path, at 2 and 4 ranks against a single-process
reference: widths the ranks cannot split evenly (loss parallel over a vocabulary of 7, a column
layer's 5 features gathered, an MC2 column layer's 7, a row layer's uneven sequence shard passed
on tagged, its features sharded with the bias); an embedding's padding_idx under RowwiseParallel.
And what a style cannot honour is a clear error, never a silent result: a keyword input its hook
cannot see, a Linear subclass whose own forward a style would replace, embedding options the
sharded lookup cannot keep, a list output where PrepareModuleOutput expects a tensor."""

import contextlib
import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyper_parallel import (ColwiseParallel, MC2ColwiseParallel, MC2RowwiseParallel, PrepareModuleOutput,
                            RowwiseParallel, full_tensor, init_device_mesh, loss_parallel, parallelize_module)
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard
from hyper_parallel.core.tensor_parallel.mc2 import MC2Contract
from hyper_parallel.core.tensor_parallel.style import _core_mesh

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
multirank = pytest.mark.skipif(WORLD < 2, reason="needs 2 or more ranks")


@pytest.fixture(scope="module")
def mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))


def same_everywhere(*shape, dtype=torch.float32, high=None):
    """A tensor equal on every rank (rank 0's)."""
    t = torch.randint(high, shape) if high is not None else torch.randn(*shape, dtype=dtype)
    dist.broadcast(t, 0)
    return t


def my_part(t, dim):
    """This rank's shard of t along dim, as torch.chunk splits it (the last ranks' may be empty)."""
    size = -(-t.size(dim) // WORLD)
    start = min(dist.get_rank() * size, t.size(dim))
    return t.narrow(dim, start, min(size, t.size(dim) - start))


def full_grad(p):
    return full_tensor(p, p.grad) if p.grad is not None else None


@multirank
def test_loss_parallel_over_a_vocabulary_the_ranks_split_unevenly(mesh):
    torch.manual_seed(3)
    vocab, dim = 7, 4  # 4 + 3 rows at 2 ranks, 2 + 2 + 2 + 1 at 4
    out = nn.Linear(dim, vocab, bias=False)
    ref = copy.deepcopy(out)
    parallelize_module(out, mesh, ColwiseParallel(use_local_output=False))
    x, labels = same_everywhere(2, 3, dim), same_everywhere(2, 3, high=vocab)
    with loss_parallel():
        loss = F.cross_entropy(out(x).flatten(0, 1), labels.flatten(0, 1))
    loss.backward()
    ref_loss = F.cross_entropy(ref(x).flatten(0, 1), labels.flatten(0, 1))
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(full_grad(out.weight), ref.weight.grad, rtol=1e-5, atol=1e-7)


@multirank
def test_a_column_layer_gathers_features_the_ranks_split_unevenly(mesh):
    torch.manual_seed(4)
    lin = nn.Linear(4, 5)
    ref = copy.deepcopy(lin)
    parallelize_module(lin, mesh, ColwiseParallel(output_layouts=Replicate()))
    x = same_everywhere(2, 3, 4)
    y = lin(x)
    torch.testing.assert_close(y, ref(x))
    y.pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    torch.testing.assert_close(full_grad(lin.weight), ref.weight.grad, rtol=1e-5, atol=1e-6)


@multirank
def test_an_mc2_column_layer_gathers_features_the_ranks_split_unevenly(mesh):
    """7 features: 4 + 3 at 2 ranks, 2 + 2 + 2 + 1 at 4; the sequence-sharded input is gathered
    by the fused op."""
    torch.manual_seed(4)
    lin = nn.Linear(4, 7)
    ref = copy.deepcopy(lin)
    parallelize_module(lin, mesh, MC2ColwiseParallel(output_layouts=Replicate(), contract=MC2Contract.relaxed()))
    x = same_everywhere(2, 2 * WORLD, 4)
    y = lin(my_part(x, 1))
    torch.testing.assert_close(y, ref(x))
    y.pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    torch.testing.assert_close(full_grad(lin.weight), ref.weight.grad, rtol=1e-5, atol=1e-6)


class RowThenColumn(nn.Module):
    def __init__(self):
        super().__init__()
        self.row, self.col = nn.Linear(8, 6), nn.Linear(6, 4)

    def forward(self, x):
        return self.col(self.row(x))


@multirank
def test_a_row_layers_uneven_sequence_shard_passes_on_tagged(mesh):
    """seq 2 * WORLD - 1 splits unevenly; the tag carries the global length to the next layer."""
    torch.manual_seed(5)
    model = RowThenColumn()
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh, {"row": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                                     "col": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    x = same_everywhere(2, 2 * WORLD - 1, 8)
    x_local = my_part(x, -1)
    torch.testing.assert_close(model(x_local), ref(x), rtol=1e-5, atol=1e-6)


@multirank
def test_a_row_layer_sharded_on_its_features_adds_its_part_of_the_bias(mesh):
    torch.manual_seed(6)
    lin = nn.Linear(8, 6)
    ref = copy.deepcopy(lin)
    parallelize_module(lin, mesh, RowwiseParallel(output_layouts=Shard(-1)))
    x = same_everywhere(3, 8)
    y = lin(my_part(x, -1))
    torch.testing.assert_close(y, my_part(ref(x), -1), rtol=1e-5, atol=1e-6)
    y.sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(full_grad(lin.bias), ref.bias.grad)


@multirank
@pytest.mark.parametrize("padding_idx", [0, 5, -1])
def test_a_row_sharded_embedding_gives_its_padding_row_no_gradient(mesh, padding_idx):
    torch.manual_seed(7)
    emb = nn.Embedding(11, 4, padding_idx=padding_idx)
    ref = copy.deepcopy(emb)
    parallelize_module(emb, mesh, RowwiseParallel(input_layouts=Replicate()))
    ids = same_everywhere(3, 5, high=11)
    ids[0, :3] = padding_idx % 11
    y = emb(ids)
    torch.testing.assert_close(y, ref(ids))
    (y * y).sum().backward()
    (ref(ids) ** 2).sum().backward()
    grad = full_grad(emb.weight)
    torch.testing.assert_close(grad, ref.weight.grad)
    assert not grad[padding_idx].any()


@multirank
@pytest.mark.parametrize("option", [dict(max_norm=1.0), dict(scale_grad_by_freq=True), dict(sparse=True)])
def test_embedding_options_a_row_sharded_lookup_cannot_keep_are_errors(mesh, option):
    name = next(iter(option))
    with pytest.raises(NotImplementedError, match=f"RowwiseParallel: expected an nn.Embedding with {name}="):
        parallelize_module(nn.Embedding(8, 4, **option), mesh, RowwiseParallel(input_layouts=Replicate()))


class HalvedLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 0.5


@multirank
@pytest.mark.parametrize("style", [RowwiseParallel, MC2RowwiseParallel])
def test_a_style_that_replaces_forward_refuses_a_subclass_with_its_own(mesh, style):
    with pytest.raises(NotImplementedError, match=f"{style.__name__}: expected a module whose forward is "
                                                  "torch.nn.modules.linear.Linear's, got HalvedLinear"):
        parallelize_module(HalvedLinear(8, 8), mesh, style())


@multirank
def test_a_column_layer_subclass_keeps_its_own_forward(mesh):
    torch.manual_seed(8)
    lin = HalvedLinear(4, 6)
    ref = copy.deepcopy(lin)
    parallelize_module(lin, mesh, ColwiseParallel(output_layouts=Replicate()))
    x = same_everywhere(2, 4)
    torch.testing.assert_close(lin(x), ref(x))


@multirank
@pytest.mark.parametrize("style", [ColwiseParallel, RowwiseParallel])
def test_an_input_passed_by_keyword_is_an_error_not_an_unconverted_input(mesh, style):
    lin = parallelize_module(nn.Linear(8, 8), mesh, style())
    with pytest.raises(ValueError, match=f"{style.__name__}: expected the input as a positional argument"):
        lin(input=torch.randn(2, 8))


class ListOutput(nn.Module):
    def forward(self, x):
        return [x, x]


@multirank
def test_prepare_module_output_of_a_list_is_an_error_not_a_pass_through(mesh):
    module = parallelize_module(ListOutput(), mesh, PrepareModuleOutput(output_layouts=Shard(0),
                                                                        desired_output_layouts=Replicate()))
    with pytest.raises(TypeError, match="PrepareModuleOutput: expected a tensor as output 0 .*got list"):
        module(torch.randn(2, 3))


class ResidualBlock(nn.Module):
    """The input read twice: by a column layer and by the residual add."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


@multirank
@pytest.mark.parametrize("use_local_output", [False, True])
def test_a_replicated_activation_read_by_a_column_layer_and_a_residual_keeps_both_gradients(
        mesh, use_local_output):
    """The column layer's input gradient is Partial, the residual's Replicate: each is reduced as
    what it is (the residual's was once summed over the ranks too)."""
    from hyper_parallel import PrepareModuleInput
    torch.manual_seed(9)
    block = ResidualBlock()
    ref = copy.deepcopy(block)
    parallelize_module(block, mesh, {"": PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Replicate(),
                                                            use_local_output=use_local_output),
                                     "fc1": ColwiseParallel(),
                                     "fc2": RowwiseParallel(use_local_output=use_local_output)})
    x = same_everywhere(2 * WORLD, 8)
    x_local = my_part(x, 0).clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    weights = same_everywhere(2 * WORLD, 8)
    (block(x_local) * weights).sum().backward()
    (ref(x_ref) * weights).sum().backward()
    torch.testing.assert_close(x_local.grad, my_part(x_ref.grad, 0), rtol=1e-5, atol=1e-6)
    for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
        p, q = block.get_parameter(name), ref.get_parameter(name)
        torch.testing.assert_close(full_grad(p), q.grad, rtol=1e-5, atol=1e-6, msg=name)


def row_then_column(mesh, seed):
    """A row layer whose output stays tagged, a column layer, their single-process copies and an
    input: ((row, col), (ref_row, ref_col), x)."""
    torch.manual_seed(seed)
    row, col = nn.Linear(8, 8), nn.Linear(8, 8)
    ref = copy.deepcopy(row), copy.deepcopy(col)
    parallelize_module(row, mesh, RowwiseParallel(input_layouts=Replicate(), use_local_output=False))
    parallelize_module(col, mesh, ColwiseParallel(output_layouts=Replicate()))
    return (row, col), ref, same_everywhere(4, 8)


def expect_same_gradients(layers, ref_layers, atol=1e-6):
    for mine, theirs in zip(layers, ref_layers):
        for p, q in zip(mine.parameters(), theirs.parameters()):
            torch.testing.assert_close(full_grad(p), q.grad, rtol=1e-5, atol=atol)


@multirank
def test_a_row_layers_tagged_output_read_by_a_column_layer_and_a_residual(mesh):
    layers, ref_layers, x = row_then_column(mesh, 10)
    for row, col in (layers, ref_layers):
        h = row(x)
        (h + col(h)).sum().backward()
    expect_same_gradients(layers, ref_layers)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(8, 8, bias=False) for _ in range(3))

    def forward(self, x):
        return self.wq(x) * self.wk(x) + self.wv(x)


@multirank
def test_three_column_layers_reading_one_prepared_input_reduce_its_gradient_once(mesh):
    """torchtitan's attention plan: one Replicate input, three column layers; their Partial
    gradients are summed locally and reduce-scattered back to the sequence shards once."""
    from hyper_parallel import PrepareModuleInput
    from hyper_parallel.core import comm
    torch.manual_seed(11)
    attn = Attention()
    ref = copy.deepcopy(attn)
    parallelize_module(attn, mesh, {"": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
                                    "wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel()})
    x = same_everywhere(2, 2 * WORLD, 8)
    x_local = my_part(x, 1).clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    out = attn(x_local)
    comm.reset_collective_counts()
    out.sum().backward()
    assert comm.collective_count("reduce_scatter") == 1
    assert comm.collective_count("all_reduce") == 0
    ref(x_ref).sum().backward()
    torch.testing.assert_close(x_local.grad, my_part(x_ref.grad, 1), rtol=1e-5, atol=1e-6)


TRANSFORMS = {"shifted": lambda t: t[:, :-1], "scaled": lambda t: t / 0.7, "cast": lambda t: t.double(),
              "softcapped": lambda t: torch.tanh(t / 3) * 3, "masked": lambda t: t.masked_fill(t > 1.5, -1.0),
              "where": lambda t: torch.where(t > 0, t, 0.5 * t), "clamped": lambda t: t.clamp_min(-1.0)}


@multirank
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_loss_parallel_over_logits_computed_from_the_sharded_ones(mesh, transform):
    """torchtitan and nanoGPT compute the loss on shifted, scaled, upcast, soft-capped or masked
    logits: each rank's piece is still its vocabulary shard (each rank once took it for whole
    logits)."""
    apply = TRANSFORMS[transform]
    torch.manual_seed(12)
    vocab, dim = 9, 4
    out = nn.Linear(dim, vocab, bias=False)
    ref = copy.deepcopy(out)
    parallelize_module(out, mesh, ColwiseParallel(use_local_output=False))
    x, labels = same_everywhere(2, 5, dim), same_everywhere(2, 5, high=vocab)
    labels = labels[:, :-1] if transform == "shifted" else labels
    with loss_parallel():
        loss = F.cross_entropy(apply(out(x)).flatten(0, 1), labels.flatten(0, 1))
    loss.backward()
    ref_loss = F.cross_entropy(apply(ref(x)).flatten(0, 1), labels.flatten(0, 1))
    ref_loss.backward()
    torch.testing.assert_close(loss.double(), ref_loss.double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(full_grad(out.weight), ref.weight.grad, rtol=1e-5, atol=1e-7)


@multirank
def test_loss_parallel_over_logits_that_lost_the_vocabulary_shards_width_is_an_error(mesh):
    out = nn.Linear(4, 8 * WORLD, bias=False)
    parallelize_module(out, mesh, ColwiseParallel(use_local_output=False))
    pred = out(torch.randn(2, 3, 4))
    labels = torch.zeros(6, dtype=torch.long)
    message = r"loss_parallel: expected a view of the vocabulary-sharded logits that keeps their vocabulary shard"
    with loss_parallel(), pytest.raises(ValueError, match=message):
        F.cross_entropy(pred[..., :2].flatten(0, 1), labels)  # a view of the logits themselves


UNTRACED = {"no_grad_scaled": (torch.no_grad, lambda pred: (pred / 0.7).flatten(0, 1)),
            "no_grad_shifted": (torch.no_grad, lambda pred: pred[:, 1:].double().flatten(0, 1)),
            "detached_masked": (torch.enable_grad, lambda pred: pred.detach().clamp_min(0).flatten(0, 1)),
            "no_grad_concatenated": (torch.no_grad, lambda pred: torch.cat([pred, pred]).flatten(0, 1))}


@multirank
@pytest.mark.parametrize("untraced", list(UNTRACED))
def test_loss_parallel_over_logits_computed_without_a_graph_is_an_error_not_a_local_loss(mesh, untraced):
    """Without autograd a tensor computed from the logits cannot be traced back to them, and read as
    whole logits each rank got its own loss (silently, with every target inside rank 0's shard, as
    here). Every rank raises: none waits in a collective."""
    grad_mode, apply = UNTRACED[untraced]
    torch.manual_seed(16)
    out = nn.Linear(4, 4 * WORLD, bias=False)
    parallelize_module(out, mesh, ColwiseParallel(use_local_output=False))
    x, labels = same_everywhere(2, 3, 4), same_everywhere(6, high=4)
    labels = {"no_grad_shifted": labels[:4], "no_grad_concatenated": torch.cat([labels, labels])}.get(untraced, labels)
    message = ("loss_parallel: expected the vocabulary-sharded logits, a view or a cast of them, where no autograd "
               "graph traces a tensor back \\(under no_grad, after detach\\), got a \\[(4|6|12), 4\\] tensor that may "
               f"come from the \\[2, 3, {4 * WORLD}\\] vocabulary-sharded logits, not holding this rank's shard of "
               f"them \\({WORLD} of {WORLD} ranks differ\\)")
    pred = out(x)
    with grad_mode(), loss_parallel(), pytest.raises(ValueError, match=message):
        F.cross_entropy(apply(pred), labels)


@multirank
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["logits", "cast", "detached_cast"])
def test_an_eval_loss_over_the_logits_or_a_cast_without_a_graph_matches_the_single_process_one(mesh, dtype, form):
    """torchtitan's eval loss: ``F.cross_entropy(pred.flatten(0, 1).float(), labels)`` under
    no_grad, over a vocabulary the ranks split unevenly; whole logits of another width beside them
    go to torch as they are."""
    apply = {"logits": lambda pred: pred.flatten(0, 1), "cast": lambda pred: pred.flatten(0, 1).double(),
             "detached_cast": lambda pred: pred.detach().flatten(0, 1).double()}[form]
    torch.manual_seed(17)
    out = nn.Linear(4, 3 * WORLD + 1, bias=False).to(dtype)
    ref = copy.deepcopy(out).double()
    parallelize_module(out, mesh, ColwiseParallel(use_local_output=False))
    x, labels = same_everywhere(2, 3, 4).to(dtype), same_everywhere(6, high=3 * WORLD + 1)
    with torch.no_grad(), loss_parallel():
        pred = out(x)
        loss = F.cross_entropy(apply(pred), labels)
        whole = ref(x.double()).flatten(0, 1)
        ref_loss = F.cross_entropy(whole, labels)
        assert F.cross_entropy(whole * 1, labels).equal(ref_loss)
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss.double(), ref_loss, rtol=tolerance, atol=tolerance)


# A detached copy of the logits [B, S, V] made to require grad, in some layout: (copy, the loss's
# [B * S, V] input computed from it, the copy's gradient as the logits').
COPY_LAYOUTS = {
    "same": lambda pred: (lambda c: (c, c.flatten(0, 1), lambda g: g))(pred.detach().requires_grad_()),
    "flat": lambda pred: (lambda c: (c, c.view(-1, pred.shape[-1]), lambda g: g.view_as(pred)))(
        pred.detach().reshape(-1).requires_grad_()),
    "class_major": lambda pred: (lambda c: (c, c.transpose(1, 2).flatten(0, 1), lambda g: g.transpose(1, 2)))(
        pred.detach().transpose(1, 2).requires_grad_())}


@multirank
@pytest.mark.parametrize("layout", list(COPY_LAYOUTS))
def test_a_loss_over_a_detached_copy_made_to_require_grad_matches_and_its_gradient_goes_back(mesh, layout):
    """A loss computed apart (chunked losses): its backward runs on a detached copy of the logits,
    whose gradient then goes into the logits' backward. The copy's graph leads to no logits; its
    leaf, the copy, has as many elements as the loss's input in any layout."""
    torch.manual_seed(18)
    out = nn.Linear(4, 3 * WORLD + 1, bias=False)
    ref = copy.deepcopy(out)
    parallelize_module(out, mesh, ColwiseParallel(use_local_output=False))
    x, labels = same_everywhere(2, 3, 4), same_everywhere(6, high=3 * WORLD + 1)
    losses, preds, copies = [], [], []
    for model, context in ((out, loss_parallel), (ref, contextlib.nullcontext)):
        preds.append(model(x))
        leaf, input, to_pred = COPY_LAYOUTS[layout](preds[-1])
        copies.append(input)
        with context():
            loss = F.cross_entropy(input.double(), labels)
        loss.backward()
        preds[-1].backward(to_pred(leaf.grad))
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(full_grad(out.weight), ref.weight.grad, rtol=1e-5, atol=1e-7)
    with loss_parallel(), pytest.raises(ValueError, match="not holding this rank's shard of them"):
        F.cross_entropy(copies[0].detach() / 0.7, labels)


@multirank
def test_a_loss_over_a_detached_copy_through_more_ops_than_the_graph_walk_follows_matches(mesh):
    """Past the walk's 64 nodes, a graph that reached no matmul is still taken as one from leaves:
    its values are compared (each rank took torch's loss of its own shard)."""
    torch.manual_seed(20)
    out = nn.Linear(4, 2 * WORLD, bias=False)
    ref = copy.deepcopy(out)
    parallelize_module(out, mesh, ColwiseParallel(use_local_output=False))
    x, labels = same_everywhere(2, 3, 4), same_everywhere(6, high=2 * WORLD)
    pred = out(x)
    input = pred.detach().requires_grad_()
    for _ in range(70):
        input = input * 1.0
    with loss_parallel():
        loss = F.cross_entropy(input.flatten(0, 1), labels)
    torch.testing.assert_close(loss, F.cross_entropy(ref(x).flatten(0, 1), labels), rtol=1e-6, atol=1e-6)


@multirank
def test_an_eval_loss_finds_its_logits_past_later_sharded_activations_and_keeps_a_nan(mesh):
    """Logits found among many later last-dim shards still alive (another model's activations);
    a NaN in them is the loss's NaN, not a mismatch."""
    out, other = nn.Linear(4, 2 * WORLD, bias=False), nn.Linear(4, 3 * WORLD, bias=False)
    parallelize_module(out, mesh, ColwiseParallel(use_local_output=False))
    parallelize_module(other, mesh, ColwiseParallel(use_local_output=False))
    x, labels = same_everywhere(2, 3, 4), same_everywhere(6, high=2 * WORLD)
    with torch.no_grad():
        pred = out(x)
        later = [other(x) for _ in range(70)]
        with loss_parallel():
            loss = F.cross_entropy(pred.double().flatten(0, 1), labels)
            expected = F.cross_entropy(pred.flatten(0, 1), labels)
            pred[0, 0, 0] = float("nan")
            assert torch.isnan(F.cross_entropy(pred.double().flatten(0, 1), labels))
    torch.testing.assert_close(loss, expected.double(), rtol=1e-6, atol=1e-7)
    assert len(later) == 70


@multirank
def test_an_untraced_tensor_that_is_the_shard_on_some_ranks_only_is_an_error_on_every_rank(mesh):
    """A mask that changed rank 0's piece only: rank 0's difference is every rank's error."""
    out = nn.Linear(4, 2 * WORLD, bias=False)
    parallelize_module(out, mesh, ColwiseParallel(use_local_output=False))
    with torch.no_grad():
        pred = out(torch.randn(2, 3, 4))
        masked = pred.masked_fill(pred > (0 if dist.get_rank() == 0 else 1e9), 0.0).flatten(0, 1)
    how = ", not holding this rank's shard" if dist.get_rank() == 0 else ", holding this rank's shard of them, but"
    message = f"vocabulary-sharded logits{how}.* \\(1 of {WORLD} ranks differ"
    with loss_parallel(), pytest.raises(ValueError, match=message):
        F.cross_entropy(masked, torch.zeros(6, dtype=torch.long))


@multirank
def test_an_eval_loss_over_a_cast_of_logits_that_are_gone_is_an_error(mesh):
    out = nn.Linear(4, 5 * WORLD, bias=False)  # no other test's logits are 5 wide on a rank
    parallelize_module(out, mesh, ColwiseParallel(use_local_output=False))
    message = (f"got a \\[6, 5\\] tensor that may come from the \\[2, 3, {5 * WORLD}\\] vocabulary-sharded logits, "
               "which are gone: nothing to compare its values with; pass the logits \\(kept alive until the loss\\)")
    with torch.no_grad(), loss_parallel(), pytest.raises(ValueError, match=message):
        F.cross_entropy(out(torch.randn(2, 3, 4)).double().flatten(0, 1), torch.zeros(6, dtype=torch.long))


@multirank
@pytest.mark.parametrize("inplace", ["relu_", "mul_"])
def test_an_in_place_op_between_a_tagged_activation_and_a_column_layer(mesh, inplace):
    """The column layer's Partial gradient passes back through the in-place op's backward."""
    layers, ref_layers, x = row_then_column(mesh, 13)
    for row, col in (layers, ref_layers):
        h = row(x)
        h = torch.relu_(h) if inplace == "relu_" else h.mul_(3)
        col(h).pow(2).sum().backward()
    expect_same_gradients(layers, ref_layers, atol=1e-5)


@multirank
def test_the_gradient_of_a_tagged_activation_taken_alone_then_a_backward(mesh):
    """autograd.grad of the tagged activation itself: its producer does not run, so the column
    layer's part is converted on its own, and nothing waits for a later backward."""
    layers, ref_layers, x = row_then_column(mesh, 14)
    grads = []
    for row, col in (layers, ref_layers):
        h = row(x)
        loss = (h + col(h)).pow(2).sum()
        grads += torch.autograd.grad(loss, h, retain_graph=True)
        loss.backward()
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-5)
    expect_same_gradients(layers, ref_layers, atol=1e-5)


class ShardedAttentionThenHead(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.wq, self.wo, self.head = nn.Linear(6, 4 * WORLD), nn.Linear(4 * WORLD, 6), nn.Linear(6, vocab)

    def forward(self, x):
        return self.head(self.wo(torch.relu(self.wq(x))))


@multirank
def test_loss_parallel_leaves_replicated_logits_to_torch_past_sharded_activations(mesh):
    """The head's logits are whole (Replicate): a Shard(-1)-tagged activation further up (as wide as
    the vocabulary here) is not theirs."""
    torch.manual_seed(15)
    model = ShardedAttentionThenHead(vocab=4)
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh, {"wq": ColwiseParallel(use_local_output=False), "wo": RowwiseParallel(),
                                     "head": ColwiseParallel(output_layouts=Replicate())})
    x, labels = same_everywhere(5, 6), same_everywhere(5, high=4)
    with loss_parallel():
        loss = F.cross_entropy(model(x), labels)
    torch.testing.assert_close(loss, F.cross_entropy(ref(x), labels), rtol=1e-6, atol=1e-6)


@multirank
@pytest.mark.parametrize("mix", ["log_softmax", "flip", "vocab_slice"])
def test_loss_parallel_over_logits_through_an_op_that_mixes_the_vocabulary_is_an_error(mesh, mix):
    """Such an op on one rank's shard is not the op on the whole logits."""
    apply = {"log_softmax": lambda t: F.log_softmax(t, -1), "flip": lambda t: t.flip(-1),
             "vocab_slice": lambda t: (t * 1)[..., :1]}[mix]
    out = nn.Linear(4, 2 * WORLD, bias=False)
    parallelize_module(out, mesh, ColwiseParallel(use_local_output=False))
    pred = apply(out(torch.randn(2, 3, 4)))
    message = "loss_parallel: expected logits computed from the vocabulary-sharded ones by ops that keep"
    with loss_parallel(), pytest.raises(ValueError, match=message):
        F.cross_entropy(pred.flatten(0, 1), torch.zeros(6, dtype=torch.long))


@multirank
@pytest.mark.parametrize("operand", ["temperature", "gate"])
def test_loss_parallel_over_logits_combined_with_a_tensor_that_takes_a_gradient_is_an_error(mesh, operand):
    """That tensor's gradient, computed beside one rank's vocabulary shard, would be the rank's part
    only (a learnable temperature's was, silently); detached, it is a constant."""
    torch.manual_seed(19)
    out, gate = nn.Linear(4, 2 * WORLD, bias=False), nn.Linear(4, 1)
    parallelize_module(out, mesh, ColwiseParallel(use_local_output=False))
    x, labels = same_everywhere(2, 3, 4), same_everywhere(6, high=2 * WORLD)
    temperature = torch.tensor(1.3, requires_grad=True)
    pred = out(x)
    combined = pred / temperature if operand == "temperature" else pred * torch.sigmoid(gate(x))
    message = ("loss_parallel: expected logits computed from the vocabulary-sharded ones and tensors that take no "
               "gradient, got one that also differentiates through (torch::autograd::AccumulateGrad|AddmmBackward0)")
    with loss_parallel(), pytest.raises(NotImplementedError, match=message):
        F.cross_entropy(combined.flatten(0, 1), labels)
    with loss_parallel():
        loss = F.cross_entropy((pred / temperature.detach()).flatten(0, 1), labels)
    whole = full_tensor(out.weight)
    ref = F.cross_entropy((x @ whole.t() / 1.3).flatten(0, 1), labels)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)


@multirank
@pytest.mark.parametrize("init", [1.0, 1.3])
@pytest.mark.parametrize("temperature", ["scalar", "per_position"])
@pytest.mark.parametrize("logits", ["frozen", "detached"])
def test_loss_parallel_over_detached_logits_over_a_learnable_temperature_is_an_error(mesh, logits, temperature,
                                                                                     init):
    """Temperature scaling of logits computed without grad: the temperature's gradient, computed beside
    one rank's vocabulary shard, would be the rank's part only (at 1.0 the values are the shard's, and it
    was, silently; at 1.3 the error said the tensor was not the logits). A temperature per position as
    wide as some ranks' shards (widths 3 and 2 here) is an error on every rank: none waits."""
    out = nn.Linear(4, 3 * WORLD - 1, bias=False)
    parallelize_module(out, mesh, ColwiseParallel(use_local_output=False))
    x, labels = same_everywhere(2, 3, 4), same_everywhere(6, high=2)
    with torch.no_grad() if logits == "frozen" else contextlib.nullcontext():
        pred = out(x)
    t = torch.full(() if temperature == "scalar" else (3,), init, requires_grad=True)
    leaf = "a \\[\\] leaf" if temperature == "scalar" else "(a \\[3\\] leaf|a leaf of another size on)"
    message = ("loss_parallel: expected logits computed from the vocabulary-sharded ones and tensors that take no "
               f"gradient, got a \\[6, (2|3)\\] tensor that also differentiates through {leaf}")
    with loss_parallel(), pytest.raises(NotImplementedError, match=message):
        F.cross_entropy((pred.detach() / (t if temperature == "scalar" else t[:, None])).flatten(0, 1), labels)


@multirank
def test_a_padding_idx_outside_the_vocabulary_is_an_error(mesh):
    """nn.Embedding checks its own; the core's lookup, reachable from C++, checks too."""
    core = RowwiseParallel(input_layouts=Replicate())._core()
    with pytest.raises(ValueError, match="RowwiseParallel: expected padding_idx in \\[-8, 8\\), got 8"):
        core.forward_embedding(torch.zeros(2, dtype=torch.long), torch.zeros(8 // WORLD, 4), 8,
                               _core_mesh(mesh), 8)
