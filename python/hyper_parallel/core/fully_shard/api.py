"""fully_shard(module, ...) for torch.nn modules, with the signature of the original's
(HyperParallel's HSDP) and of PyTorch FSDP2's.

A call makes one C++ parameter group (``_C.FullyShardParamGroup``) of the module's parameters
that no earlier call took (apply it bottom-up: each block, then the root) and installs hooks on
the module: before its forward the group is gathered (one all-gather) and its gathered parameters
stand in for the shards in the ``_parameters`` of the modules that own them, for the whole
forward (FSDP2's scope: a tied head reading ``emb.weight`` reads it whole); after it the outputs
pass through a C++ node that gathers the group again for the backward (if it was resharded), the
shards are put back and the group is resharded (``reshard_after_forward``). While the module's
backward runs (from its outputs' gradients to its inputs', or to the end of the backward) the
owning modules hold views of the gathered parameters instead, for code that reads them there
outside any module's forward (a checkpointed region's recomputation). The owning modules have
hooks too, for a call outside the module's forward (checkpoint's recomputation, a direct call).
The gradients reach the shards' ``.grad`` through reduce-scatters of buckets that leave as
autograd produces them (one per group with ``comm_fusion=True``), averaged over the data-parallel
ranks (then all-reduced over the replicate dim of an HSDP mesh). The module's class becomes a
subclass of FSDPModule (HSDPModule) with the original's methods.
"""

from typing import Iterable, List, Optional, Union

import torch
from torch import nn

from hyper_parallel import _C
from hyper_parallel.core.dtensor.placement_types import Shard
from hyper_parallel.core.fully_shard.fsdp_module import FSDPModule, HSDPModule, _bool
from hyper_parallel.core.fully_shard.hooks import cast_outputs, install_hooks
from hyper_parallel.core.fully_shard.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from hyper_parallel.core.fully_shard.state_dict import make_values_local, shards_in_state_dict
# The original's import path of these two.
from hyper_parallel.core.fully_shard.model_state_dict import (  # noqa: F401  pylint: disable=unused-import
    get_model_state_dict, set_model_state_dict)
from hyper_parallel.core.tensor_parallel.style import _core_mesh

__all__ = ["CPUOffloadPolicy", "FSDPModule", "HSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "fully_shard",
           "get_model_state_dict", "hsdp_sync_stream", "set_model_state_dict"]


def hsdp_sync_stream() -> None:
    """The original's wait for in-flight reductions: they are complete when backward() returns."""


_EXTENDED = {}


def _extend_class(module: nn.Module) -> None:
    cls = type(module)
    if cls not in _EXTENDED:
        _EXTENDED[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.__class__ = _EXTENDED[cls]


def _roots(module) -> list:
    """The modules of a fully_shard call: ``module``, or those of a list that no other one of
    the list contains (a module listed twice, or below another, is a part of that one)."""
    if isinstance(module, nn.Module):
        modules = [module]
    elif isinstance(module, list) and module:
        modules = module
    else:
        got = "an empty list" if isinstance(module, list) else type(module).__name__
        raise ValueError(f"fully_shard: expected an nn.Module or a non-empty list of them, got {got}")
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise ValueError(f"fully_shard: expected an nn.Module or a list of them, got {type(m).__name__} at "
                             f"index {i} of the list")
    below = [set(other.modules()) - {other} for other in modules]
    roots = []
    for m in modules:
        if not any(m in inside for inside in below) and m not in roots:
            roots.append(m)
    for m in roots:  # one below another of the list may be sharded already (bottom-up)
        if isinstance(m, FSDPModule):
            where = f" at index {next(i for i, o in enumerate(modules) if o is m)} of the list" if len(modules) > 1 \
                else ""
            raise ValueError(f"fully_shard: expected a module fully_shard was not applied to, got "
                             f"{type(m).__name__}{where}")
    return roots


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _reshard_after_forward(value, mesh) -> bool:
    """FSDP2's int reshard_after_forward, the size of the group holding the parameters between
    forward and backward: 1 keeps them gathered (False), the shard group's size frees them (True);
    a size between (a smaller group) is a NotImplementedError, another a ValueError."""
    if value is None:
        return True
    if not _is_int(value):
        return value
    shard_size = _core_mesh(mesh).size(-1)
    if value < 1 or shard_size % value:
        raise ValueError(f"fully_shard: expected an int reshard_after_forward that divides the shard group's size "
                         f"({shard_size}), got {value}")
    if value in (1, shard_size):
        return value != 1
    raise NotImplementedError(f"fully_shard: an int reshard_after_forward between 1 and the shard group's size "
                              f"({shard_size}), resharding to a smaller group after the forward, is not supported; "
                              f"expected 1 (False), {shard_size} (True) or a bool, got {value}")


def _check_options(reshard_after_forward, shard_placement_fn, mp_policy, offload_policy, replicate_params,
                   comm_fusion):
    if reshard_after_forward is not None and not _is_int(reshard_after_forward):
        _bool(reshard_after_forward, "fully_shard reshard_after_forward")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(f"fully_shard: expected a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if mp_policy.output_dtype is not None and not (isinstance(mp_policy.output_dtype, torch.dtype) and
                                                   mp_policy.output_dtype.is_floating_point):
        raise ValueError(f"fully_shard: expected MixedPrecisionPolicy output_dtype None or a floating dtype, got "
                         f"{mp_policy.output_dtype!r}")
    _bool(mp_policy.apply_grad_on_fp32_main_grad, "MixedPrecisionPolicy apply_grad_on_fp32_main_grad")
    if not isinstance(offload_policy, OffloadPolicy):
        raise ValueError(f"fully_shard: expected an OffloadPolicy, got {type(offload_policy).__name__}")
    if replicate_params:
        raise NotImplementedError("fully_shard: replicate_params is not supported; pass them as ignored_params and "
                                  "average their gradients with hyper_parallel.data_parallel")
    _bool(comm_fusion, "fully_shard comm_fusion")
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise ValueError("fully_shard: expected a callable shard_placement_fn, got "
                         f"{type(shard_placement_fn).__name__}")


def _owned_parameters(roots: list, ignored: set, shard_placement_fn):
    """[(owner module, parameter name, parameter, qualified name)] of the parameters to manage,
    each listed under every module that holds it; the names of a list's modules' parameters begin
    with their index in it."""
    owned, seen = [], {}
    walk = [(f"{i}." if len(roots) > 1 else "", path, sub) for i, root in enumerate(roots)
            for path, sub in root.named_modules(remove_duplicate=False)]
    for prefix, path, sub in walk:
        for name, param in sub.named_parameters(recurse=False):
            if id(param) in ignored or _C.FullyShardParamGroup.is_managed(param):
                continue
            qualified = prefix + (f"{path}.{name}" if path else name)
            if shard_placement_fn is not None and id(param) not in seen:
                placement = shard_placement_fn(param)
                if placement is not None and placement != Shard(0):
                    raise NotImplementedError(f"fully_shard: shard_placement_fn gave {placement} for {qualified}; "
                                              "only Shard(0) (or None) is supported")
            seen.setdefault(id(param), qualified)
            owned.append((sub, name, param, qualified))
    return owned, seen


def _check_earlier_calls(module: nn.Module, ignored: set) -> None:
    """A parameter of ``module`` that an earlier call manages must be one that call stands in for
    wherever ``module`` reads it: the call was on a module below, and the module holding the
    parameter is one of that call's. Otherwise (fully_shard on a child after its parent, or a
    parameter tied across two calls) the holder's forward would read this rank's piece."""
    calls = {}
    for path, below in module.named_modules():
        if isinstance(below, FSDPModule) and below._fsdp_group is not None:
            calls.update((id(p), (path, below)) for p in below._fsdp_group.parameters)
    for path, sub in module.named_modules(remove_duplicate=False):
        for name, param in sub.named_parameters(recurse=False):
            if id(param) in ignored or not _C.FullyShardParamGroup.is_managed(param):
                continue
            call_path, call = calls.get(id(param), (None, None))
            if call is not None and sub in call._fsdp_owners:
                continue
            qualified = f"{path}.{name}" if path else name
            got = ("a call on a module above or beside it" if call is None else
                   f"the call on {call_path or 'the module itself'}, which does not hold it")
            raise ValueError(f"fully_shard: expected {qualified} unmanaged, or managed by an earlier call on a "
                             f"module below that holds it, got it managed by {got} (apply fully_shard bottom-up, "
                             "and shard the modules sharing a parameter in one call)")


def fully_shard(module: Union[nn.Module, List[nn.Module]], *, mesh=None,
                reshard_after_forward: Optional[Union[bool, int]] = True, shard_placement_fn=None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(), ignored_params: Optional[Iterable] = None,
                replicate_params: Optional[Iterable] = None, comm_fusion: bool = False,
                comm_fusion_zero_copy: Optional[bool] = None, sharded_accumulated_grad: bool = False,
                row_sparse_embeddings: bool = True) -> Union[nn.Module, List[nn.Module]]:
    """Shards ``module``'s parameters that no earlier call took on dim 0 over ``mesh`` (1-d, or
    2-d (replicate, shard) for HSDP; default: 1-d over the world) and returns it, now an
    FSDPModule. ``reshard_after_forward`` True frees the gathered parameters after the forward
    (gathered again for the backward), False keeps them to the end of the backward; as an int
    (FSDP2's), 1 is False and the shard group's size True.
    ``comm_fusion``: False (the default) reduce-scatters the gradients in buckets as autograd
    produces them (most of them travel during the group's own backward); True in one message per
    group, when its backward is over. Either way the group gathers in one message and the
    gradients are bitwise the same. A group whose one parameter is an
    ``nn.Embedding``'s weight gathers in its forward only the rows of its ids and reduce-scatters
    only the gradient rows of the tokens some rank saw (bitwise the dense run);
    ``row_sparse_embeddings=False`` keeps it dense.

    The original's ``comm_fusion_zero_copy`` (shards as views of one flat buffer, so its fused
    gather reads them in place) is accepted and changes nothing here: the gather copies the
    shards into its one message either way. Its ``sharded_accumulated_grad=True`` (MindSpore only
    there) is a NotImplementedError: ``set_requires_all_reduce(False)`` holds the reduce-scattered
    sums for one all-reduce per step.

    ``module`` may be a list of modules (``fully_shard([model.norm, model.output])``): one group
    of all their parameters, gathered by the first of them whose forward runs and resharded once
    each has run; each becomes an FSDPModule of that group, and the list is returned. Collective
    over the mesh."""
    roots = _roots(module)
    _check_options(reshard_after_forward, shard_placement_fn, mp_policy, offload_policy, replicate_params,
                   comm_fusion)
    _bool(row_sparse_embeddings, "fully_shard row_sparse_embeddings")
    if comm_fusion_zero_copy is not None:
        _bool(comm_fusion_zero_copy, "fully_shard comm_fusion_zero_copy")
    if _bool(sharded_accumulated_grad, "fully_shard sharded_accumulated_grad"):
        raise NotImplementedError("fully_shard: sharded_accumulated_grad=True is the original's MindSpore-only mode; "
                                  "expected False, got True (module.set_requires_all_reduce(False) holds the "
                                  "reduce-scattered sums for one all-reduce per step)")
    if mesh is None:
        import torch.distributed as dist  # pylint: disable=import-outside-toplevel

        from hyper_parallel.core.dtensor import init_device_mesh  # pylint: disable=import-outside-toplevel
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    reshard_after_forward = _reshard_after_forward(reshard_after_forward, mesh)
    ignored = {id(p) for p in (ignored_params or ())}
    for root in roots:
        _check_earlier_calls(root, ignored)
    owned, names = _owned_parameters(roots, ignored, shard_placement_fn)
    for sub, _, param, _ in owned:
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            raise NotImplementedError(f"fully_shard: expected embeddings with dense gradients, got "
                                      f"{type(sub).__name__}(sparse=True) owning {names[id(param)]}: its sparse "
                                      f"gradient is not reduce-scattered; drop sparse=True (an nn.Embedding in a "
                                      f"fully_shard call of its own sends only the rows its ids touch)")
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.max_norm is not None and param.requires_grad \
                and mesh.size() > 1:
            raise NotImplementedError(f"fully_shard: expected trainable embeddings without max_norm, got "
                                      f"{type(sub).__name__}(max_norm={sub.max_norm}) owning {names[id(param)]}: "
                                      "its forward renormalizes the rows it looks up in place, in the gathered "
                                      "weight, which the shards the optimizer steps on never see (renormalize "
                                      "the looked-up rows out of place, or freeze the weight)")
    # The group first: what it refuses (the mesh, mixed dtypes) leaves the modules as they were.
    callers = _callers(roots)
    group = _new_group(callers, owned, names, mesh, reshard_after_forward, mp_policy, offload_policy, comm_fusion,
                       row_sparse_embeddings) if owned else None
    for root in roots:
        _extend_class(root)
        root._register_load_state_dict_pre_hook(make_values_local, with_module=True)
        root._register_state_dict_hook(shards_in_state_dict)
    if group is not None:
        _hook_group(group, roots, callers, owned, mp_policy)
    elif mp_policy.output_dtype is not None:  # no group's hooks: the outputs are still cast, as FSDP2's
        for root in roots:
            root.register_forward_hook(lambda mod, args, output: cast_outputs(output, mp_policy))
    for root in roots:
        _share_pass_order(root)
    return module


def _callers(roots: list) -> dict:
    """The modules whose calls make a pass of the group -> the module of the call each belongs
    to: the module; a list's modules, where a container among them (an ``nn.ModuleList`` or
    ``nn.ModuleDict``, never called itself) stands for the modules in it."""
    if len(roots) == 1:
        return {roots[0]: roots[0]}
    callers = {}

    def add(module, root):
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            for child in module.children():
                add(child, root)
        else:
            callers.setdefault(module, root)

    for root in roots:
        add(root, root)
    return callers


def _new_group(callers, owned, names, mesh, reshard_after_forward, mp_policy, offload_policy, comm_fusion,
               row_sparse_embeddings):
    """The C++ group of the ``owned`` parameters."""
    params = {id(p): p for _, _, p, _ in owned}
    order = list(params)
    group = _C.FullyShardParamGroup(
        [params[k] for k in order], [names[k] for k in order], _core_mesh(mesh),
        reshard_after_forward, mp_policy.param_dtype,
        mp_policy.reduce_dtype, isinstance(offload_policy, CPUOffloadPolicy),
        getattr(offload_policy, "pin_memory", False), reduce_bucket_cap_bytes=0 if comm_fusion else None,
        apply_grad_on_fp32_main_grad=mp_policy.apply_grad_on_fp32_main_grad)
    holders = {sub for sub, _, _, _ in owned}
    first = next(iter(callers))
    # One module's forward is a pass by itself, and the owners called on their own (outside it)
    # make one once each has run; a list's modules make one once each of them has run.
    group.set_users(len(callers) if len(callers) > 1 else max(1, sum(1 for sub in holders if sub is not first)))
    # Only the embedding's own forward reads the rows of its ids: a module around it may read more.
    if (row_sparse_embeddings and len(callers) == 1 and isinstance(first, nn.Embedding) and holders == {first} and
            len(order) == 1):
        group.set_row_sparse_gradients(True)
    return group


def _hook_group(group, roots, callers, owned, mp_policy) -> None:
    """The hooks that drive ``group`` on the modules of the call and those holding its parameters."""
    index = {}  # as _new_group ordered them
    for _, _, param, _ in owned:
        index.setdefault(id(param), len(index))
    owners = {}
    for sub, name, param, _ in owned:
        owners.setdefault(sub, []).append((name, index[id(param)]))
    standing = install_hooks(group, owners, mp_policy, callers)
    for root in roots:
        root._fsdp_group = group
        root._fsdp_owners = tuple(owners)
        root._fsdp_standing = standing
        root._fsdp_mp_policy = mp_policy


def _share_pass_order(root: nn.Module) -> None:
    """The root's groups and those below it prefetch in the order their forwards ran."""
    _C.FullyShardParamGroup.share_pass_order(
        [m._fsdp_group for m in root.modules() if isinstance(m, FSDPModule) and m._fsdp_group is not None])
