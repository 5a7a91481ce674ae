"""Data parallelism over a mesh dimension: a module's gradients averaged over ``mesh["dp"]`` by
bucketed all-reduces that run during the backward (the C++ core's GradientReducer, as DDP).

Usage (4 ranks: TP 2 inside, DP 2 across)::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], plan)
    data_parallel(model, mesh["dp"])
    loss.backward()          # gradients averaged over dp when it returns
    optimizer.step()
    with no_sync(model):     # accumulate only; the next backward outside averages the sum
        loss2.backward()
"""

import contextlib

import torch

from hyper_parallel import _C

__all__ = ["data_parallel", "gradient_reducer", "no_sync"]

_REDUCER = "_hp_gradient_reducer"


def data_parallel(module: torch.nn.Module, device_mesh, *, bucket_cap_mb: float = 25, overlap: bool = True,
                  gradient_as_bucket_view: bool = False, row_sparse_embeddings: bool = True,
                  broadcast_buffers: bool = True, init_sync: bool = True):
    """Averages ``module``'s gradients over ``device_mesh`` (1-D: the data-parallel dimension)
    and returns the module. Parallelize it over its other dimensions first. As DDP, it first
    gives every rank the parameters and buffers of the mesh's rank 0 (``init_sync=False``: the
    caller has made them equal), and with ``broadcast_buffers`` (default) rank 0's buffers again
    before a forward that follows a training forward (grad enabled, outside ``no_sync``) or
    starts the first, so batch norm statistics stay equal: every rank of the mesh then runs
    those forwards (evaluate on one rank with ``broadcast_buffers=False``). Buckets of at most
    ``bucket_cap_mb`` MiB, in reverse parameter order and, after the first backward, in the
    order it produced the gradients, the last ones (ready at the backward's end) smaller;
    ``overlap=False`` reduces each bucket, blocking, when it is ready (bitwise the same result).
    ``gradient_as_bucket_view=True``: as DDP's, each reduced ``.grad`` lives in its bucket, so
    the next backward accumulates there with no copy in or out (a ``.grad`` reference taken
    before the first reduction is not updated; after a failed backward, zero the gradients or
    set them to None: they hold unspecified values). The weights of ``torch.nn.Embedding``
    submodules are reduced row-sparse: only the rows of the tokens a step saw travel (bitwise
    the dense result); ``row_sparse_embeddings=False`` reduces them dense (a weight tied to the
    output projection has every row, which the row-sparse op only finds out after a round trip
    of counts). Collective: every rank of the mesh calls it, with the same parameters and
    options."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"data_parallel: expected a torch.nn.Module, got {type(module).__name__}")
    if hasattr(module, _REDUCER):
        raise ValueError("data_parallel: expected a module data_parallel has not been applied to, got one it has")
    for name, sub in module.named_modules():
        if isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse and sub.weight.requires_grad:
            raise TypeError(f"data_parallel: expected embeddings with dense gradients, got {type(sub).__name__}"
                            f"(sparse=True) at {name or 'the module'} (its rows already travel row-sparse: "
                            f"construct it with sparse=False)")
        if isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.max_norm is not None and \
                sub.weight.requires_grad and getattr(device_mesh, "size", lambda: 2)() > 1:
            raise NotImplementedError(f"data_parallel: expected trainable embeddings without max_norm, got "
                                      f"{type(sub).__name__}(max_norm={sub.max_norm}) at {name or 'the module'}: "
                                      "its forward renormalizes in place the rows this rank looks up, so the "
                                      "replicas diverge (renormalize the looked-up rows out of place, or freeze "
                                      "the weight)")
    embeddings = {id(m.weight): m.weight for m in module.modules()
                  if row_sparse_embeddings and isinstance(m, torch.nn.Embedding) and m.weight.requires_grad}
    params = [(f"parameter {n}", p) for n, p in module.named_parameters()]
    buffers = [(f"buffer {n}", b) for n, b in module.named_buffers()]
    reducer = _C.data_parallel([p for _, p in params], device_mesh, int(bucket_cap_mb * (1 << 20)), overlap,
                               gradient_as_bucket_view, list(embeddings.values()), [n for n, _ in params])
    if init_sync:
        _replica_sync(params + buffers, device_mesh)()
    if broadcast_buffers and buffers:
        _sync_buffers_before_training_forwards(module, _replica_sync(buffers, device_mesh), reducer)
    object.__setattr__(module, _REDUCER, reducer)
    return module


def _replica_sync(named_states, device_mesh):
    return _C.ReplicaSync([s for _, s in named_states], device_mesh, [n for n, _ in named_states])


def _sync_buffers_before_training_forwards(module, sync, reducer):
    # DDP's rule: the buffers travel before the first forward and before one that follows a
    # training forward; an evaluation forward (no grad) or one in no_sync does not send them next.
    due = [True]

    def before(_module, _args):
        if due[0]:
            sync()

    def after(_module, _args, _output):
        due[0] = torch.is_grad_enabled() and reducer.sync

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def gradient_reducer(module: torch.nn.Module):
    """The reducer data_parallel installed on ``module`` (its buckets, its sync flag)."""
    reducer = getattr(module, _REDUCER, None)
    if reducer is None:
        raise ValueError(f"gradient_reducer: expected a module made data-parallel by data_parallel(), got a plain "
                         f"{type(module).__name__}")
    return reducer


@contextlib.contextmanager
def no_sync(module: torch.nn.Module):
    """Inside, backward passes only accumulate gradients locally; the first backward after it
    averages the accumulated sums (gradient accumulation)."""
    reducer = gradient_reducer(module)
    previous = reducer.sync
    reducer.sync = False
    try:
        yield
    finally:
        reducer.sync = previous
