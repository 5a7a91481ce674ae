"""Loss parallel, spelled as PyTorch's: cross-entropy over logits sharded on the vocabulary,
never gathered. The logits are those of an output projection whose style keeps them sharded and
tagged (``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``), a view of them
(``pred.flatten(0, 1)``), or a tensor computed from them that keeps the vocabulary shard's width
(``pred.float()``, ``pred / temperature``, ``pred[:, :-1]``, masking); one computed from them
through an op that may mix the vocabulary dim (a softmax, a slice of it) is an error, and so is one
that also takes a gradient to another tensor (``pred / learned_temperature``). Under
no_grad, after detach, or with every parameter frozen no graph traces a tensor back: the logits,
their views and casts of them (``pred.flatten(0, 1).float()``, the logits kept alive) are recognized
by their values, and another tensor that may come from them (a scale, a shift) is an error::

    with loss_parallel():
        loss = F.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1))
    loss.backward()

The computation (one all-gather of the row maxima and two all-reduces, none in backward; float32
inside) is the C++ core's. Inside the context ``F.cross_entropy`` takes that path for such
logits and behaves as usual for any other tensor.
"""

import contextlib

import torch
import torch.nn.functional as F  # patched inside the context

from hyper_parallel import _C

__all__ = ["loss_parallel"]


def _vocabulary_sharded(tagged) -> bool:
    placements = tagged.placements
    return len(placements) == 1 and placements[0].is_shard() and placements[0].dim in (-1, len(tagged.shape) - 1)


def _sharded_logits(input: torch.Tensor):
    """The DTensor of the vocabulary-sharded logits ``input`` is (or is a view of, or was computed
    from keeping their width), else None."""
    t = input
    while t is not None:
        tagged = _C.DTensor.from_tagged(t)
        if tagged is not None:
            return tagged if _vocabulary_sharded(tagged) else None
        t = t._base
    # Computed from them: a local shard read as whole logits would give each rank its own loss.
    tagged, mixed_by, other_gradient, from_leaves_only = _C.DTensor.trace_back(input)
    if tagged is None and (input.grad_fn is None or from_leaves_only):
        # Where its values came from is not traced (no_grad, detach): the shard of logits whose values
        # it holds, if any; an error where it may have been computed from such a shard.
        return _C.untraced_vocab_shard_source(input)
    if tagged is None or not _vocabulary_sharded(tagged):
        return None
    if mixed_by:
        raise ValueError(f"loss_parallel: expected logits computed from the vocabulary-sharded ones by ops that keep "
                         f"each vocabulary entry apart (views, casts, elementwise arithmetic, masking), got one "
                         f"through {mixed_by}, which may mix a rank's shard; pass the logits (or a view) instead")
    if other_gradient:
        raise NotImplementedError(f"loss_parallel: expected logits computed from the vocabulary-sharded ones and "
                                  f"tensors that take no gradient, got one that also differentiates through "
                                  f"{other_gradient}: computed beside this rank's vocabulary shard, that gradient "
                                  f"would be this rank's part only; detach that operand (a learnable temperature)")
    width = tagged.to_local().shape[-1]
    if input.dim() == 0 or input.shape[-1] != width:
        raise ValueError(f"loss_parallel: expected logits that keep this rank's vocabulary shard ({width} wide) "
                         f"in the last dim, got shape {list(input.shape)} computed from the sharded logits")
    return tagged


@contextlib.contextmanager
def loss_parallel():
    original = F.cross_entropy

    def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                      reduction="mean", label_smoothing=0.0):
        sharded = _sharded_logits(input)
        if sharded is None:
            return original(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        if input.dim() != 2:
            raise ValueError(f"loss_parallel: expected 2-d logits [N, vocab shard] (e.g. pred.flatten(0, 1)), "
                             f"got {list(input.shape)}")
        if weight is not None or size_average is not None or reduce is not None or reduction != "mean" or \
                label_smoothing != 0.0:
            raise NotImplementedError("loss_parallel: only the mean cross-entropy without weight or label "
                                      "smoothing is supported")
        if bool((target == ignore_index).any()):
            raise NotImplementedError(f"loss_parallel: targets equal to ignore_index ({ignore_index}) are not "
                                      "supported")
        return _C.vocab_parallel_cross_entropy(input, target, sharded.shape[-1], sharded.device_mesh)

    F.cross_entropy = cross_entropy
    try:
        yield
    finally:
        F.cross_entropy = original
