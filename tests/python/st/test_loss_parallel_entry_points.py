"""loss_parallel whatever calls torch's cross-entropy: F.cross_entropy, a ``cross_entropy``
imported from torch.nn.functional before the context opened, nn.CrossEntropyLoss. Outside the
context, logits sharded over the vocabulary on more than one rank are a ValueError, not this
rank's loss; over one rank, and for any other tensor, torch's loss as usual (also in TorchScript).
Against the single-process loss."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import cross_entropy  # bound before any context opens

from hyper_parallel import ColwiseParallel, full_tensor, init_device_mesh, loss_parallel, parallelize_module

VOCAB, DIM = 10, 4


def vocab_sharded_head(mesh):
    torch.manual_seed(3)
    head = nn.Linear(DIM, VOCAB, bias=False)
    reference = copy.deepcopy(head)
    return parallelize_module(head, mesh, ColwiseParallel(use_local_output=False)), reference


def inputs():
    torch.manual_seed(4)
    return torch.randn(2, 3, DIM), torch.randint(VOCAB, (2, 3))


ENTRY_POINTS = {"F.cross_entropy": lambda x, y: F.cross_entropy(x, y),
                "imported_before": lambda x, y: cross_entropy(x, y),
                "nn.CrossEntropyLoss": lambda x, y: nn.CrossEntropyLoss()(x, y)}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_loss_parallel_takes_every_entry_point_to_torchs_cross_entropy(entry):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    head, reference = vocab_sharded_head(mesh)
    x, labels = inputs()
    with loss_parallel():
        loss = ENTRY_POINTS[entry](head(x).flatten(0, 1), labels.flatten())
    loss.backward()
    expected = F.cross_entropy(reference(x).flatten(0, 1), labels.flatten())
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(full_tensor(head.weight, head.weight.grad), reference.weight.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_vocabulary_sharded_logits_outside_loss_parallel_are_an_error(entry):
    if dist.get_world_size() < 2:
        pytest.skip("a vocabulary sharded over more than one rank needs 2 ranks")
    head, _ = vocab_sharded_head(init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",)))
    x, labels = inputs()
    message = r"cross_entropy: expected logits sharded over the vocabulary .* inside loss_parallel\(\), got \[6, "
    for logits in (head(x).flatten(0, 1), head(x).flatten(0, 1).float() * 2):  # the logits; computed from them
        with pytest.raises(ValueError, match=message):
            ENTRY_POINTS[entry](logits, labels.flatten())


def scripted_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def test_outside_loss_parallel_other_logits_take_torchs_loss_also_in_torchscript():
    x, labels = inputs()
    logits = torch.randn(6, VOCAB, requires_grad=True)
    expected = torch.nn.functional.log_softmax(logits, -1).gather(1, labels.flatten()[:, None]).mean().neg()
    torch.testing.assert_close(F.cross_entropy(logits, labels.flatten()), expected)
    torch.testing.assert_close(torch.jit.script(scripted_loss)(logits, labels.flatten()), expected)
    wrapped = torch._C._nn.cross_entropy_loss  # called directly: torch's binding, its own defaults
    assert torch.equal(wrapped(logits, labels.flatten()), wrapped._torch_own(logits, labels.flatten()))
    # A vocabulary "sharded" over one rank is the whole vocabulary: torch's loss is right.
    head, reference = vocab_sharded_head(
        init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("dp", "tp"))["tp"])
    torch.testing.assert_close(F.cross_entropy(head(x).flatten(0, 1), labels.flatten()),
                               F.cross_entropy(reference(x).flatten(0, 1), labels.flatten()))


OPTIONS = {"ignore_padding": dict(ignore_index=-100), "ignore_a_class": dict(ignore_index=3),
           "label_smoothing": dict(label_smoothing=0.1), "sum": dict(reduction="sum"), "none": dict(reduction="none"),
           "smoothing_ignore_sum": dict(label_smoothing=0.2, ignore_index=-100, reduction="sum")}


@pytest.mark.parametrize("options", list(OPTIONS))
def test_loss_parallel_takes_torchs_options(options):
    """ignore_index (targets of -100 padding, or a class), label_smoothing and each reduction: the
    loss and the gradients of the unsharded head, through one backward of a weighted sum."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    head, reference = vocab_sharded_head(mesh)
    x, labels = inputs()
    labels = labels.flatten()
    labels[::4] = -100 if options != "ignore_a_class" else 3
    kwargs = OPTIONS[options]
    with loss_parallel():
        loss = F.cross_entropy(head(x).flatten(0, 1), labels, **kwargs)
    expected = F.cross_entropy(reference(x).flatten(0, 1), labels, **kwargs)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    weights = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape)
    (loss * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(full_tensor(head.weight, head.weight.grad), reference.weight.grad, rtol=1e-5, atol=1e-6)


def test_loss_parallel_over_targets_all_ignored_is_nan_with_zero_gradients_as_torchs():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    head, _ = vocab_sharded_head(mesh)
    x, _ = inputs()
    with loss_parallel():
        loss = F.cross_entropy(head(x).flatten(0, 1), torch.full((6,), -100))
    assert torch.isnan(loss)
    loss.backward()  # torch's gradient of an all-ignored mean is zero
    assert torch.equal(head.weight.grad, torch.zeros_like(head.weight))
    with loss_parallel():
        with pytest.raises(NotImplementedError, match="expected no class weight"):
            F.cross_entropy(head(x).flatten(0, 1), torch.zeros(6, dtype=torch.long), weight=torch.ones(VOCAB))


def test_loss_parallel_errors_name_what_was_expected():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    head, _ = vocab_sharded_head(mesh)
    x, labels = inputs()
    logits, labels = head(x).flatten(0, 1), labels.flatten()
    with loss_parallel():
        with pytest.raises(ValueError, match=r"expected label_smoothing in \[0, 1\], got 1.5"):
            F.cross_entropy(logits, labels, label_smoothing=1.5)
        with pytest.raises(ValueError, match=r"expected targets in \[0, 10\) or ignore_index \(-100\), got values "
                                             r"in \[-5, 12\]"):
            F.cross_entropy(logits, labels.index_fill(0, torch.tensor([0, 1, 2]), -100)
                            .index_fill(0, torch.tensor([3]), -5).index_fill(0, torch.tensor([4]), 12))
        with pytest.raises(NotImplementedError, match=r"expected class indices as targets \(an integer tensor\), "
                                                      r"got Float targets \(class probabilities are not supported"):
            F.cross_entropy(logits, torch.softmax(torch.randn(logits.shape[0], VOCAB), -1))
    from hyper_parallel import _C
    with pytest.raises(ValueError, match=r"DTensor::carry_tag: expected a tensor of the tagged one's shape \[2, 3, "):
        _C.DTensor.carry_tag(head(x), torch.zeros(2))


def test_the_originals_mesh_and_strict_options():
    from hyper_parallel.core.tensor_parallel import is_loss_parallel_active

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    head, reference = vocab_sharded_head(mesh)
    x, labels = inputs()
    expected = F.cross_entropy(reference(x).flatten(0, 1), labels.flatten())
    assert not is_loss_parallel_active()
    with loss_parallel(mesh=mesh, strict=False):
        assert is_loss_parallel_active()
        with loss_parallel():  # nested: the logits' own mesh
            torch.testing.assert_close(F.cross_entropy(head(x).flatten(0, 1), labels.flatten()), expected)
        torch.testing.assert_close(F.cross_entropy(head(x).flatten(0, 1), labels.flatten()), expected)
        if dist.get_world_size() > 1:  # strict=False still refuses a wrong result
            with pytest.raises(ValueError, match="loss_parallel: expected logits"):
                F.cross_entropy(head(x).softmax(-1).flatten(0, 1), labels.flatten())
    assert not is_loss_parallel_active()
    other = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))["dp"]
    with loss_parallel(mesh=other):
        with pytest.raises(ValueError, match="expected logits sharded over the mesh given"):
            F.cross_entropy(head(x).flatten(0, 1), labels.flatten())
    with pytest.raises(TypeError, match="expected mesh a DeviceMesh or None, got str"):
        with loss_parallel(mesh="tp"):
            pass


def test_strict_must_be_a_bool():
    with pytest.raises(TypeError, match="loss_parallel: expected strict a bool, got str"):
        with loss_parallel(strict="no"):
            pass
