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

import math
from typing import Iterable, List, Optional, Union

import torch
from torch import nn

from hyper_parallel import _C
from hyper_parallel.core.dtensor.placement_types import Shard
from hyper_parallel.core.fully_shard.hooks import cast_inputs, cast_outputs, install_hooks
from hyper_parallel.core.fully_shard.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from hyper_parallel.core.fully_shard.state_dict import make_values_local, shards_in_state_dict, warn_if_assign
# The original's import path of these two.
from hyper_parallel.core.fully_shard.model_state_dict import (  # noqa: F401  pylint: disable=unused-import
    get_model_state_dict, set_model_state_dict)
from hyper_parallel.core.tensor_parallel.style import _core_mesh

__all__ = ["CPUOffloadPolicy", "FSDPModule", "HSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "fully_shard",
           "get_model_state_dict", "hsdp_sync_stream", "set_model_state_dict"]


class _UnshardHandle:
    """unshard(async_op=True)'s handle: wait() waits for the gather (the module's next forward
    waits for it too)."""

    def __init__(self, group):
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


def _bool(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{what}: expected a bool, got {type(value).__name__} {value!r}")
    return value


class FSDPModule:
    """The methods fully_shard adds to a module (its class becomes a subclass of this one)."""

    _fsdp_group = None  # the C++ group (None when nested calls took every parameter)
    _fsdp_owners = ()  # the modules whose parameters the group stands in for

    def __call__(self, *args, **kwargs):
        # Torch 1.13's forward pre-hooks do not see keyword arguments (the pre-hook casts the
        # positional ones), and its forward hooks do not run when a forward raises: the call's
        # gathered parameters are put back here, and its group's open calls ended. The inputs
        # pass through the node that ends the module's backward.
        if self._fsdp_group is not None:
            if kwargs:
                kwargs = cast_inputs(kwargs, self._fsdp_mp_policy) or kwargs
            args, kwargs = self._fsdp_standing.with_post_backward(args, kwargs)
        try:
            return super().__call__(*args, **kwargs)
        except BaseException:
            if self._fsdp_group is not None:
                self._fsdp_group.abandon_forward()
                self._fsdp_standing.put_back()
            raise

    def _apply(self, fn, *args, **kwargs):
        # torch's conversions (to, double, to_empty) reach the shards (resharded first, as FSDP2
        # does); a parameter they replace by a new tensor (to_empty from meta, FSDP2's deferred
        # initialization, or any conversion with torch.__future__'s overwrite flag) joins the group.
        if self._fsdp_group is not None:
            if not self._fsdp_standing.shards_in_place:
                raise ValueError(f"FSDPModule: expected a conversion (to, double, to_empty, ...) of "
                                 f"{type(self).__name__} outside its forward and backward, got one while its gathered "
                                 "parameters stand in for the shards")
            self._fsdp_group.reshard()
        module = super()._apply(fn, *args, **kwargs)
        if self._fsdp_group is not None:
            self._fsdp_standing.adopt_replaced()
        return module

    def _fsdp_modules(self, recurse: bool):
        if not recurse:
            return [self]
        return [m for m in self.modules() if isinstance(m, FSDPModule)]

    def unshard(self, async_op: bool = False) -> Optional[_UnshardHandle]:
        """Gathers this module's parameters (not recursive); async_op: starts the gather and
        returns a handle to wait for it. Collective."""
        _bool(async_op, "FSDPModule.unshard async_op")
        if self._fsdp_group is not None:
            self._fsdp_group.unshard(async_op)
        return _UnshardHandle(self._fsdp_group) if async_op else None

    def reshard(self) -> None:
        """Frees this module's gathered parameters (not recursive)."""
        if self._fsdp_group is not None:
            self._fsdp_group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: the backwards add the gathered gradients up without communication; the next
        backward with sync on reduce-scatters the sum."""
        _bool(requires_gradient_sync, "FSDPModule.set_requires_gradient_sync")
        for m in self._fsdp_modules(recurse):
            if m._fsdp_group is not None:
                m._fsdp_group.set_requires_gradient_sync(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """False (HSDP): the backwards reduce-scatter over the shard dim into sums the groups
        hold, without the all-reduce over the replicate dim, and leave .grad as it is; the next
        backward with all-reduce on all-reduces the held sums with its own and writes .grad. No
        effect on a 1-d mesh."""
        _bool(requires_all_reduce, "FSDPModule.set_requires_all_reduce")
        for m in self._fsdp_modules(recurse):
            if m._fsdp_group is not None:
                m._fsdp_group.set_requires_all_reduce(requires_all_reduce)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's load_state_dict, where a sharded parameter's value may be this rank's piece (as
        state_dict() gives it), the whole tensor (each rank takes its piece, without
        communication: pass the same whole tensors on every rank) or a DTensor (its local
        tensor), as the original's. Another shape is a ValueError naming both."""
        if self._fsdp_group is not None and not self._fsdp_standing.shards_in_place:
            raise ValueError(f"FSDPModule.load_state_dict: expected a load into {type(self).__name__} outside its "
                             "forward and backward, got one while its gathered parameters stand in for the shards")
        warn_if_assign(assign)
        return super().load_state_dict(state_dict, strict=strict)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for code written for the original and FSDP2, where False lets the end of a
        micro-batch's backward skip waiting for its reductions. Here every backward waits for them,
        so .grad is complete when backward() returns: the flag changes no result and no wait."""
        _bool(is_last_backward, "FSDPModule.set_is_last_backward")

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        _bool(reshard_after_forward, "FSDPModule.set_reshard_after_forward")
        for m in self._fsdp_modules(recurse):
            if m._fsdp_group is not None:
                m._fsdp_group.set_reshard_after_forward(reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, recurse: bool = True) -> None:
        """False: the parameters stay gathered after the backward, so the next forward (of the
        next micro-batch) gathers them again only if an optimizer step changed them."""
        _bool(reshard_after_backward, "FSDPModule.set_reshard_after_backward")
        for m in self._fsdp_modules(recurse):
            if m._fsdp_group is not None:
                m._fsdp_group.set_reshard_after_backward(reshard_after_backward)

    def set_gradient_scaling_factor(self, factor) -> None:
        """Multiplies this module's reduced gradients (after the average over the dp ranks):
        None (1), a float, an int or a one-element tensor; a bool is a ValueError."""
        if isinstance(factor, bool) or not (factor is None or isinstance(factor, (int, float)) or
                                            (isinstance(factor, torch.Tensor) and factor.numel() == 1)):
            raise ValueError(f"FSDPModule.set_gradient_scaling_factor: expected None, a number or a one-element "
                             f"tensor, got {type(factor).__name__} {factor!r}")
        if self._fsdp_group is not None:
            self._fsdp_group.set_gradient_scaling_factor(1.0 if factor is None else float(factor))

    def set_reduce_op_type(self, reduce_op_type: str) -> None:
        """How the data-parallel ranks' gradients of this module's group combine: "avg" (the
        default) or "sum" (no division by the data-parallel size), as the original's; not
        recursive."""
        ops = {"avg": _C.ReduceOp.AVG, "sum": _C.ReduceOp.SUM}
        op = ops.get(reduce_op_type.lower().strip()) if isinstance(reduce_op_type, str) else None
        if op is None:
            raise ValueError(f"FSDPModule.set_reduce_op_type: expected one of {list(ops)}, got {reduce_op_type!r}")
        if self._fsdp_group is not None:
            self._fsdp_group.set_reduce_op(op)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """FSDP2's: this module's group sums the dp ranks' gradients and divides by ``factor``
        (> 0; the default divides by the dp size). Sets the reduce op to "sum" and the gradient
        scaling factor to 1 / factor; not recursive."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < math.inf:
            raise ValueError(f"FSDPModule.set_gradient_divide_factor: expected a finite number > 0, got {factor!r}")
        if self._fsdp_group is not None:
            self._fsdp_group.set_reduce_op(_C.ReduceOp.SUM)
            self._fsdp_group.set_gradient_scaling_factor(1.0 / factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's deprecated name of set_gradient_divide_factor."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for code written for FSDP2, where True sums in the collectives and divides
        around them (for fp16, or backends without an average): the same average, up to
        rounding, which the reductions here compute either way (they sum 16-bit gradients in
        fp32)."""
        _bool(enable, "FSDPModule.set_force_sum_reduction_for_comms")

    def _prefetch_groups(self, modules, what: str):
        if not isinstance(modules, (list, tuple)):
            raise ValueError(f"{what}: expected a list of FSDPModule, got {type(modules).__name__}")
        for m in modules:
            if not isinstance(m, FSDPModule):
                raise ValueError(f"{what}: expected a list of FSDPModule, got {type(m).__name__} in it")
        return [m._fsdp_group for m in modules if m._fsdp_group is not None]

    def set_modules_to_forward_prefetch(self, modules) -> None:
        """These modules' gathers start as soon as this one's forward begins (beside the implicit
        prefetch of the module that came next in the last pass)."""
        self._fsdp_forward_prefetch = self._prefetch_groups(modules, "FSDPModule.set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules) -> None:
        """These modules' gathers start as soon as this one's backward begins."""
        self._fsdp_backward_prefetch = self._prefetch_groups(modules, "FSDPModule.set_modules_to_backward_prefetch")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the .grad of every parameter of this module and those below it, or with
        set_to_none=False zeroes it in place (torch.nn.Module.zero_grad's meaning)."""
        for p in self.parameters():
            if set_to_none or p.grad is None:
                p.grad = None
                continue
            if p.grad.grad_fn is not None:
                p.grad.detach_()
            else:
                p.grad.requires_grad_(False)
            p.grad.zero_()


HSDPModule = FSDPModule  # the original's name


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
    roots = []
    for m in modules:
        if all(m is other or m not in set(other.modules()) for other in modules) and m not in roots:
            roots.append(m)
    for m in roots:  # one below another of the list may be sharded already (bottom-up)
        if isinstance(m, FSDPModule):
            where = f" at index {next(i for i, o in enumerate(modules) if o is m)} of the list" if len(modules) > 1 \
                else ""
            raise ValueError(f"fully_shard: expected a module fully_shard was not applied to, got "
                             f"{type(m).__name__}{where}")
    return roots


def _check_options(reshard_after_forward, shard_placement_fn, mp_policy, offload_policy, replicate_params,
                   comm_fusion):
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError("fully_shard: an int reshard_after_forward (resharding to a smaller group after the "
                                  f"forward) is not supported; expected True or False, got {reshard_after_forward}")
    if reshard_after_forward is not None:
        _bool(reshard_after_forward, "fully_shard reshard_after_forward")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(f"fully_shard: expected a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if mp_policy.output_dtype is not None and not (isinstance(mp_policy.output_dtype, torch.dtype) and
                                                   mp_policy.output_dtype.is_floating_point):
        raise ValueError(f"fully_shard: expected MixedPrecisionPolicy output_dtype None or a floating dtype, got "
                         f"{mp_policy.output_dtype!r}")
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
    (gathered again for the backward), False keeps them to the end of the backward.
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
        True if reshard_after_forward is None else reshard_after_forward, mp_policy.param_dtype,
        mp_policy.reduce_dtype, isinstance(offload_policy, CPUOffloadPolicy),
        getattr(offload_policy, "pin_memory", False), reduce_bucket_cap_bytes=0 if comm_fusion else None)
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
