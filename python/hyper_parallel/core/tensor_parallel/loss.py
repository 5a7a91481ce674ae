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

As PyTorch's, ``F.nll_loss(F.log_softmax(pred, -1), labels)`` works too: inside the context the
log_softmax of such logits over their last dim (``F.log_softmax``, ``torch.log_softmax``,
``Tensor.log_softmax``, ``nn.LogSoftmax``) is vocabulary-parallel, each rank holding its shard of the
log-probabilities (sharded as the logits), and ``F.nll_loss`` / ``nn.NLLLoss`` of such a tensor reads
each target's entry on the rank that holds it. Other reductions of that shard over the vocabulary
(``.sum(-1)``) remain a rank's part.

The computation (one all-gather of the row maxima and two all-reduces, none in backward; float32
inside; for 16-bit logits the loss is float32, where torch's is in their dtype) is the C++ core's.
Importing the package wraps torch's ``cross_entropy_loss``, which ``F.cross_entropy`` and
``nn.CrossEntropyLoss`` call however they were imported, and ``nll_loss_nd`` (``F.nll_loss``,
``nn.NLLLoss``): inside the context such logits take that path; outside it, logits sharded over more
than one rank (and log-probabilities of them) are a ValueError (torch's loss would read this rank's
shard as the whole vocabulary); any other tensor is torch's as usual.
"""

import contextlib

import torch
import torch.jit._builtins
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hyper_parallel import _C

__all__ = ["is_loss_parallel_active", "loss_parallel"]


def _vocabulary_sharded(tagged) -> bool:
    placements = tagged.placements
    return len(placements) == 1 and placements[0].is_shard() and placements[0].dim in (-1, len(tagged.shape) - 1)


def _sharded_logits(input: torch.Tensor, agree: bool = True):
    """The DTensor of the vocabulary-sharded logits ``input`` is (or is a view of, or was computed
    from keeping their width), else None. Where its graph does not trace it back (no_grad, detach),
    its values are compared with the logits alive; ``agree=False``: on this rank alone (no
    collective, no error: None unless it holds them)."""
    t = input
    while t is not None:
        tagged = _C.DTensor.from_tagged(t)
        if tagged is not None:
            if not _vocabulary_sharded(tagged):
                return None
            _check_keeps_the_vocabulary_last(input, t)
            return tagged
        t = t._base
    # Computed from them: a local shard read as whole logits would give each rank its own loss.
    tagged, mixed_by, other_gradient, from_leaves_only = _C.DTensor.trace_back(input)
    if tagged is None and (input.grad_fn is None or from_leaves_only):
        if not agree:
            return _C.local_vocab_shard_source(input)
        # Where its values came from is not traced (no_grad, detach): the shard of logits whose values
        # it holds, if any; an error where it may have been computed from such a shard.
        return _C.untraced_vocab_shard_source(input)
    if tagged is None or not _vocabulary_sharded(tagged):
        return None
    if mixed_by:
        raise ValueError(f"loss_parallel: expected logits computed from the vocabulary-sharded ones by ops that keep "
                         f"each vocabulary entry apart (views, casts, elementwise arithmetic, masking), got one "
                         f"through {mixed_by}, which may mix a rank's shard; pass the logits (or a view) instead "
                         f"(a log_softmax over the vocabulary is vocabulary-parallel inside loss_parallel())")
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


def _check_keeps_the_vocabulary_last(view: torch.Tensor, logits: torch.Tensor):
    """A view of the logits read as logits must keep their vocabulary dim last (a transpose of square
    logits would be as wide, with rows where the vocabulary was)."""
    if view is logits:
        return
    if view.dim() == 0 or view.shape[-1] != logits.shape[-1] or \
            (view.shape[-1] > 1 and view.stride(-1) != logits.stride(-1)):
        raise ValueError(f"loss_parallel: expected a view of the vocabulary-sharded logits that keeps their vocabulary "
                         f"shard ({logits.shape[-1]} wide) as its last dim, got shape {list(view.shape)}, strides "
                         f"{list(view.stride())} of logits {list(logits.shape)}, strides {list(logits.stride())}")


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


def _check_loss_input(input, weight):
    if input.dim() != 2:
        raise ValueError(f"loss_parallel: expected 2-d logits [N, vocab shard] (e.g. pred.flatten(0, 1)), "
                         f"got {list(input.shape)}")
    if weight is not None:
        raise NotImplementedError("loss_parallel: expected no class weight, got one (a weight per vocabulary entry "
                                  "is not supported)")


def _vocab_parallel(input, target, sharded, weight=None, reduction=0, ignore_index=-100, label_smoothing=0.0):
    """The vocabulary-parallel loss, given torch's cross_entropy_loss arguments (its defaults: the
    binding's own reduction is none; F.cross_entropy passes every one)."""
    _check_loss_input(input, weight)
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


# torch's own nll_loss_nd (F.nll_loss and nn.NLLLoss call it), wrapped as cross_entropy_loss is.
_torch_nll_loss_nd = getattr(torch._C._nn.nll_loss_nd, "_torch_own", torch._C._nn.nll_loss_nd)


def _nll_loss_nd(input, target, weight=None, reduction=1, ignore_index=-100):
    """torch's nll_loss_nd. Inside loss_parallel(), a vocabulary-sharded input (log-probabilities
    of its log_softmax, or the logits) takes the vocabulary-parallel loss; outside, it is an error
    (torch's would read this rank's shard as the whole vocabulary)."""
    if _open_meshes:
        sharded = _sharded_logits(input)
        if sharded is not None:
            _check_mesh(sharded.device_mesh)
            _check_loss_input(input, weight)
            return _C.vocab_parallel_nll_loss(input, target, sharded.shape[-1], sharded.device_mesh, ignore_index,
                                              reduction)
    elif _tagged_vocabulary_shard(input) is not None:
        raise ValueError(f"nll_loss: expected log-probabilities of logits sharded over the vocabulary taken inside "
                         f"loss_parallel(), got {list(input.shape)} computed from such logits outside it, where "
                         f"torch's loss would read this rank's shard as the whole vocabulary")
    return _torch_nll_loss_nd(input, target, weight, reduction, ignore_index)


_nll_loss_nd._torch_own = _torch_nll_loss_nd
torch._C._nn.nll_loss_nd = _nll_loss_nd
torch.jit._builtins._register_builtin(_nll_loss_nd, "aten::nll_loss_nd")


def _softmax_dim(ndim):
    return 0 if ndim in (0, 1, 3) else 1  # F.log_softmax's implicit dim (deprecated in torch)


def _vocab_parallel_log_softmax(func, args, kwargs):
    """The vocabulary-parallel log_softmax of ``func``'s arguments (F.log_softmax(input, dim,
    _stacklevel, dtype), torch.log_softmax(input, dim, dtype), Tensor.log_softmax(self, dim,
    dtype)) when its input is vocabulary-sharded logits and its dim their last; else None."""
    input = args[0] if args else kwargs.get("input", kwargs.get("self"))
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    dtype_at = 3 if func is F.log_softmax else 2
    dtype = args[dtype_at] if len(args) > dtype_at else kwargs.get("dtype")
    if not isinstance(input, torch.Tensor) or input.dim() == 0:
        return None
    dim = _softmax_dim(input.dim()) if dim is None else dim
    if not isinstance(dim, int) or dim not in (-1, input.dim() - 1):
        return None  # over another dim each vocabulary entry stays apart: torch's is right
    # Judged locally: any tensor of a shard's width may take a log_softmax inside the context (on
    # one rank, for logging) and must cost no collective; one that holds the logits' values (an eval
    # under no_grad of pred.float()) is theirs. The loss then checks agreement.
    sharded = _sharded_logits(input, agree=False)
    if sharded is None:
        return None
    _check_mesh(sharded.device_mesh)
    if dtype is not None:
        input = input.to(dtype)
    return _C.vocab_parallel_log_softmax(input, sharded.shape[-1], sharded.device_mesh).to_local_tagged()


_LOG_SOFTMAX = (F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax, torch.special.log_softmax)


class _LogSoftmaxOverTheVocabulary(TorchFunctionMode):
    """Open with loss_parallel(): a log_softmax of vocabulary-sharded logits over their last dim
    is the vocabulary-parallel one; every other call is torch's."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LOG_SOFTMAX:
            result = _vocab_parallel_log_softmax(func, args, kwargs)
            if result is not None:
                return result
        return func(*args, **kwargs)


def _check_mesh(logits_mesh):
    mesh = _open_meshes[-1]
    if mesh is not None and mesh != logits_mesh:
        raise ValueError(f"loss_parallel: expected logits sharded over the mesh given, {mesh}, got logits sharded "
                         f"over {logits_mesh}")


@contextlib.contextmanager
def loss_parallel(*, mesh=None, strict: bool = True):
    """Inside, a cross-entropy of the vocabulary-sharded logits (F.cross_entropy, nn.CrossEntropyLoss,
    or F.nll_loss of their F.log_softmax) is computed in parallel over the vocabulary (see the
    module's doc). As the original's:
    ``mesh``, if given, is the mesh the logits must be sharded over (a ValueError otherwise;
    None takes the logits' own); contexts nest. ``strict=False`` is accepted, and changes nothing:
    each check here guards a result that would be wrong, so it raises whatever ``strict`` is."""
    if mesh is not None and not isinstance(mesh, _C.DeviceMesh):
        raise TypeError(f"loss_parallel: expected mesh a DeviceMesh or None, got {type(mesh).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"loss_parallel: expected strict a bool, got {type(strict).__name__}")
    _open_meshes.append(mesh)
    try:
        with _LogSoftmaxOverTheVocabulary():
            yield
    finally:
        _open_meshes.pop()


def is_loss_parallel_active() -> bool:
    """Whether a loss_parallel() context is open (the original's)."""
    return bool(_open_meshes)
