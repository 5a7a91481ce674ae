"""loss_parallel's unfused cross-entropy, as PyTorch's: inside the context a log_softmax of
vocabulary-sharded logits over their last dim is vocabulary-parallel (each rank its shard of the
log-probabilities) and nll_loss of it reads each target on the rank holding it; loss and gradients
equal the single-process ones for every way torch spells them, every reduction, ignored targets,
16-bit logits and a vocabulary with fewer entries than ranks. Outside the context, nll_loss of such
log-probabilities is a ValueError, not this rank's loss."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyper_parallel import ColwiseParallel, full_tensor, init_device_mesh, loss_parallel, parallelize_module

DIM = 4


def vocab_sharded_head(vocab, dtype=torch.float32):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(3)
    head = nn.Linear(DIM, vocab, bias=False).to(dtype)
    reference = copy.deepcopy(head)
    return parallelize_module(head, mesh, ColwiseParallel(use_local_output=False)), reference


def inputs(vocab, dtype=torch.float32):
    torch.manual_seed(4)
    return torch.randn(2, 3, DIM).to(dtype), torch.randint(vocab, (6,))


SPELLINGS = {
    "F": lambda x, y, **kw: F.nll_loss(F.log_softmax(x, -1), y, **kw),
    "modules": lambda x, y, **kw: nn.NLLLoss(**kw)(nn.LogSoftmax(dim=1)(x), y),
    "method": lambda x, y, **kw: F.nll_loss(x.log_softmax(-1), y, **kw),
    "torch.log_softmax": lambda x, y, **kw: F.nll_loss(torch.log_softmax(x, dim=1), y, **kw),
    "implicit_dim": lambda x, y, **kw: F.nll_loss(F.log_softmax(x), y, **kw),  # torch's legacy dim 1 of 2-d
    "float64": lambda x, y, **kw: F.nll_loss(F.log_softmax(x, -1, dtype=torch.float64), y, **kw),
}
OPTIONS = {"mean": {}, "sum": dict(reduction="sum"), "none": dict(reduction="none"),
           "ignore": dict(ignore_index=-100), "ignore_a_class": dict(ignore_index=2)}


@pytest.mark.parametrize("vocab", [10, 3])  # 3: fewer entries than ranks on 4
@pytest.mark.parametrize("spelling", list(SPELLINGS))
@pytest.mark.parametrize("options", list(OPTIONS))
def test_nll_loss_of_log_softmax_matches_the_single_process_loss(vocab, spelling, options):
    head, reference = vocab_sharded_head(vocab)
    x, labels = inputs(vocab)
    if options.startswith("ignore"):
        labels[::4] = OPTIONS[options]["ignore_index"]
    kwargs = OPTIONS[options]
    with loss_parallel():
        loss = SPELLINGS[spelling](head(x).flatten(0, 1), labels, **kwargs)
    expected = SPELLINGS[spelling](reference(x).flatten(0, 1), labels, **kwargs)
    torch.testing.assert_close(loss, expected.to(loss.dtype), rtol=1e-6, atol=1e-6)
    weights = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape)
    (loss * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(full_tensor(head.weight, head.weight.grad), reference.weight.grad, rtol=1e-5, atol=1e-6)


def test_the_log_probabilities_are_this_ranks_shard_and_differentiate_as_torchs():
    """Any use of them: a weighted sum of the shard (each rank's part of the whole sum) gives the
    head the gradient of the whole sum (the backward's all-reduce)."""
    vocab = 10
    head, reference = vocab_sharded_head(vocab)
    x, _ = inputs(vocab)
    r, p = dist.get_rank(), dist.get_world_size()
    expected = F.log_softmax(reference(x), -1)
    start = sum(c.shape[-1] for c in expected.chunk(p, -1)[:r])
    with loss_parallel():
        log_probs = F.log_softmax(head(x), -1)
    width = log_probs.shape[-1]
    torch.testing.assert_close(log_probs, expected[..., start:start + width], rtol=1e-6, atol=1e-6)
    weights = torch.linspace(-1, 2, 2 * 3 * vocab).reshape(2, 3, vocab)
    (log_probs * weights[..., start:start + width]).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(full_tensor(head.weight, head.weight.grad), reference.weight.grad, rtol=1e-5, atol=1e-6)


def test_16_bit_logits_give_16_bit_log_probabilities_and_a_float32_loss():
    head, reference = vocab_sharded_head(10, torch.bfloat16)
    x, labels = inputs(10, torch.bfloat16)
    with loss_parallel():
        log_probs = F.log_softmax(head(x).flatten(0, 1), -1)
        loss = F.nll_loss(log_probs, labels)
    assert log_probs.dtype == torch.bfloat16 and loss.dtype == torch.float32
    expected = F.nll_loss(F.log_softmax(reference(x).flatten(0, 1).float(), -1), labels)
    torch.testing.assert_close(loss, expected, rtol=2e-2, atol=2e-2)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(full_tensor(head.weight, head.weight.grad).float(), reference.weight.grad.float(),
                               rtol=3e-2, atol=3e-2)


def test_a_log_softmax_over_another_dim_is_torchs():
    head, reference = vocab_sharded_head(10)
    x, _ = inputs(10)
    r, p = dist.get_rank(), dist.get_world_size()
    with loss_parallel():
        over_rows = F.log_softmax(head(x), 0)
    expected = F.log_softmax(reference(x), 0).chunk(p, -1)[r]
    torch.testing.assert_close(over_rows, expected, rtol=1e-6, atol=1e-6)


def test_errors_name_what_was_expected():
    vocab = 3  # on 4 ranks one holds no entry: every rank still raises, none waits in a collective
    head, _ = vocab_sharded_head(vocab)
    x, labels = inputs(vocab)
    logits = head(x).flatten(0, 1)
    with loss_parallel():
        log_probs = F.log_softmax(logits, -1)
        with pytest.raises(TypeError, match=r"vocab_parallel_nll_loss: expected int64 class indices as targets "
                                            r"\(as torch's losses take\), got Int targets"):
            F.nll_loss(log_probs, labels.int())
        with pytest.raises(TypeError, match=r"vocab_parallel_cross_entropy: expected int64 class indices"):
            F.cross_entropy(logits, labels.int())
        with pytest.raises(NotImplementedError, match="expected no class weight"):
            F.nll_loss(log_probs, labels, weight=torch.ones(vocab))
        with pytest.raises(ValueError, match=r"expected 2-d logits \[N, vocab shard\]"):
            F.nll_loss(F.log_softmax(head(x), -1), labels.view(2, 3))
    if dist.get_world_size() == 1:
        return
    local = F.log_softmax(logits, -1)  # outside the context: this rank's shard alone
    with loss_parallel():
        with pytest.raises(ValueError, match=r"got one through LogSoftmaxBackward0, which may mix a rank's shard"):
            F.nll_loss(local, labels)
    for outside in (log_probs, local, logits):
        with pytest.raises(ValueError, match=r"nll_loss: expected log-probabilities of logits sharded over the "
                                             r"vocabulary taken inside loss_parallel\(\), got \[6, "):
            F.nll_loss(outside, labels)


def test_a_view_that_moves_the_vocabulary_dim_is_an_error():
    """Square local logits transposed are as wide as the shard: read as logits, each rank's loss
    would be of the wrong entries."""
    p = dist.get_world_size()
    head, _ = vocab_sharded_head(6 * p)
    x = torch.randn(6, DIM)
    logits = head(x)  # [6, 6] on every rank
    with loss_parallel():
        for view, entry in ((logits.t(), F.cross_entropy), (logits.t(), F.log_softmax)):
            with pytest.raises(ValueError, match=r"expected a view of the vocabulary-sharded logits that keeps their "
                                                 r"vocabulary shard \(6 wide\) as its last dim, got shape \[6, 6\], "
                                                 r"strides \[1, 6\]"):
                entry(view, torch.zeros(6, dtype=torch.long)) if entry is F.cross_entropy else entry(view, -1)


def test_a_log_softmax_of_another_tensor_of_a_shards_width_is_torchs_on_any_rank():
    """Under no_grad, or of a leaf: not traced to the logits, so torch's, with no collective (one
    rank alone may take it, for logging)."""
    head, _ = vocab_sharded_head(10)
    x, _ = inputs(10)
    logits = head(x)  # alive: its width is a shard's
    other = torch.randn(6, logits.shape[-1])
    with loss_parallel():
        if dist.get_rank() == 0:
            with torch.no_grad():
                torch.testing.assert_close(F.log_softmax(other, -1), torch.log_softmax(other, -1))
            leaf = other.clone().requires_grad_()
            torch.testing.assert_close(F.log_softmax(leaf, -1), torch.log_softmax(other, -1))
    dist.barrier()


def test_a_double_backward_through_the_loss_is_an_error_not_a_wrong_penalty():
    head, _ = vocab_sharded_head(10)
    x, labels = inputs(10)
    with loss_parallel():
        for loss in (F.nll_loss(F.log_softmax(head(x).flatten(0, 1), -1), labels),
                     F.cross_entropy(head(x).flatten(0, 1), labels)):
            with pytest.raises(NotImplementedError, match=r"Backward: expected a backward without create_graph, got "
                                                          r"create_graph=True"):
                torch.autograd.grad(loss, head.weight, create_graph=True)


@pytest.mark.parametrize("form", ["cast", "view_then_cast", "detached"])
def test_an_eval_loss_under_no_grad_of_a_cast_of_the_logits_is_the_single_process_one(form):
    """No graph traces pred.float() back: the log_softmax judges it by its values, on each rank."""
    head, reference = vocab_sharded_head(10, torch.bfloat16)
    x, labels = inputs(10, torch.bfloat16)
    make = {"cast": lambda pred: pred.float().flatten(0, 1), "view_then_cast": lambda pred: pred.flatten(0, 1).float(),
            "detached": lambda pred: pred.detach().flatten(0, 1)}[form]
    with torch.no_grad(), loss_parallel():
        pred = head(x)
        loss = F.nll_loss(F.log_softmax(make(pred), -1), labels)
        expected = F.nll_loss(F.log_softmax(make(reference(x)).float(), -1), labels)
    torch.testing.assert_close(loss, expected.to(loss.dtype), rtol=1e-2, atol=1e-2)
