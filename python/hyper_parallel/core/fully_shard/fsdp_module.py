"""FSDPModule (the original's HSDPModule): the methods fully_shard adds to a module, whose class
becomes a subclass of it. Each acts on the module's C++ parameter group (``_fsdp_group``), or on
the groups of the modules below it (``recurse``)."""

from typing import Optional

import torch

from hyper_parallel import _C
from hyper_parallel.core.fully_shard.hooks import cast_inputs
from hyper_parallel.core.fully_shard.state_dict import warn_if_assign

__all__ = ["FSDPModule", "HSDPModule"]


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
        tensor), as the original's. Another shape is a ValueError naming both, as is a load inside
        the module's forward or backward (the load pre-hook, make_values_local, checks both)."""
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

    def set_gradient_scaling_factor(self, factor=None) -> None:
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
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise ValueError(f"FSDPModule.set_gradient_divide_factor: expected a finite number > 0, got {factor!r}")
        if self._fsdp_group is not None:
            self._fsdp_group.set_gradient_divide_factor(float(factor))
        else:
            _C.FullyShardParamGroup.check_gradient_divide_factor(float(factor))

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
        """Drops the .grad (and ``main_grad``, MixedPrecisionPolicy apply_grad_on_fp32_main_grad's)
        of every parameter of this module and those below it, or with set_to_none=False zeroes
        them in place (torch.nn.Module.zero_grad's meaning)."""
        for p in self.parameters():
            if getattr(p, "main_grad", None) is not None:
                if set_to_none:
                    p.main_grad = None
                else:
                    p.main_grad.zero_()
            if set_to_none or p.grad is None:
                p.grad = None
                continue
            if p.grad.grad_fn is not None:
                p.grad.detach_()
            else:
                p.grad.requires_grad_(False)
            p.grad.zero_()


HSDPModule = FSDPModule  # the original's name
