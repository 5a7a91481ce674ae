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
inside) is the C++ core's. Importing the package wraps torch's ``cross_entropy_loss``, which
``F.cross_entropy`` and ``nn.CrossEntropyLoss`` call however they were imported: inside the
context such logits take that path; outside it, logits sharded over more than one rank are a
ValueError (torch's loss would read this rank's shard as the whole vocabulary); any other tensor
is torch's as usual.
"""

import contextlib

import torch
import torch.jit._builtins

from hyper_parallel import _C

__all__ = ["is_loss_parallel_active", "loss_parallel"]


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


def _tagged_vocabulary_shard(input: torch.Tensor):
    """The DTensor of the vocabulary-sharded logits over more than one rank that ``input`` is, is a
    view of or was computed from (what the autograd graph shows), else None."""
    t = input
    while t is not None:
        tagged = _C.DTensor.from_tagged(t)
        if tagged is not None:
            break
        t = t._base
    else:
        tagged = _C.DTensor.trace_back(input)[0]
    if tagged is None or not _vocabulary_sharded(tagged) or tagged.device_mesh.size() == 1:
        return None
    return tagged


def _vocab_parallel(input, target, sharded, weight=None, reduction=0, ignore_index=-100, label_smoothing=0.0):
    """The vocabulary-parallel loss, given torch's cross_entropy_loss arguments (its defaults: the
    binding's own reduction is none; F.cross_entropy passes every one)."""
    if input.dim() != 2:
        raise ValueError(f"loss_parallel: expected 2-d logits [N, vocab shard] (e.g. pred.flatten(0, 1)), "
                         f"got {list(input.shape)}")
    if weight is not None:
        raise NotImplementedError("loss_parallel: expected no class weight, got one (a weight per vocabulary entry "
                                  "is not supported)")
    return _C.vocab_parallel_cross_entropy(input, target, sharded.shape[-1], sharded.device_mesh, ignore_index,
                                           reduction, label_smoothing)


# torch's own, also when this module is imported again (importlib.reload) over the wrapper.
_torch_cross_entropy_loss = getattr(torch._C._nn.cross_entropy_loss, "_torch_own", torch._C._nn.cross_entropy_loss)
_OPTIONS = ("weight", "reduction", "ignore_index", "label_smoothing")  # its arguments after the target
_open_meshes = []  # the mesh of each open loss_parallel() (None: the logits' own), innermost last


def _cross_entropy_loss(input, target, *args, **kwargs):
    """torch's cross_entropy_loss, which F.cross_entropy and nn.CrossEntropyLoss call however they
    were imported. Inside loss_parallel(), vocabulary-sharded logits take the vocabulary-parallel
    loss; outside, they are an error (torch's loss of this rank's shard would be a loss of its
    own); any other tensor is torch's, given the arguments as they came."""
    if _open_meshes:
        sharded = _sharded_logits(input)
        if sharded is not None:
            _check_mesh(sharded.device_mesh)
            return _vocab_parallel(input, target, sharded, **dict(zip(_OPTIONS, args)), **kwargs)
    elif _tagged_vocabulary_shard(input) is not None:
        raise ValueError(f"cross_entropy: expected logits sharded over the vocabulary (a style's "
                         f"output_layouts=Shard(-1), use_local_output=False) inside loss_parallel(), got "
                         f"{list(input.shape)} logits computed from them outside it, where torch's loss would "
                         f"read this rank's shard as the whole vocabulary")
    return _torch_cross_entropy_loss(input, target, *args, **kwargs)


_cross_entropy_loss._torch_own = _torch_cross_entropy_loss
torch._C._nn.cross_entropy_loss = _cross_entropy_loss
torch.jit._builtins._register_builtin(_cross_entropy_loss, "aten::cross_entropy_loss")  # scripted code calls aten's


def _check_mesh(logits_mesh):
    mesh = _open_meshes[-1]
    if mesh is not None and mesh != logits_mesh:
        raise ValueError(f"loss_parallel: expected logits sharded over the mesh given, {mesh}, got logits sharded "
                         f"over {logits_mesh}")


@contextlib.contextmanager
def loss_parallel(*, mesh=None, strict: bool = True):
    """Inside, a cross-entropy of the vocabulary-sharded logits (F.cross_entropy, nn.CrossEntropyLoss)
    is computed in parallel over the vocabulary (see the module's doc). As the original's:
    ``mesh``, if given, is the mesh the logits must be sharded over (a ValueError otherwise;
    None takes the logits' own); contexts nest. ``strict=False`` is accepted, and changes nothing:
    each check here guards a result that would be wrong, so it raises whatever ``strict`` is."""
    if mesh is not None and not isinstance(mesh, _C.DeviceMesh):
        raise TypeError(f"loss_parallel: expected mesh a DeviceMesh or None, got {type(mesh).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"loss_parallel: expected strict a bool, got {type(strict).__name__}")
    _open_meshes.append(mesh)
    try:
        yield
    finally:
        _open_meshes.pop()


def is_loss_parallel_active() -> bool:
    """Whether a loss_parallel() context is open (the original's)."""
    return bool(_open_meshes)
