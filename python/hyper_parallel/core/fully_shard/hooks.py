"""The hooks fully_shard installs on a module and on the modules owning its parameters: what
stands in their ``_parameters`` (the gathered parameters during a call, views of them during the
module's backward, the shards otherwise), the pre-backward node on the outputs and the
post-backward node on the inputs."""

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from hyper_parallel import _C
from hyper_parallel.core.fully_shard.policies import MixedPrecisionPolicy

__all__ = ["cast_inputs", "cast_outputs", "install_hooks"]


def _with_pre_backward(group, output, prefetch, on_backward=None):
    """``output`` (any nesting of tuples, lists and dicts) with each tensor passed through the
    group's pre-backward node; ``on_backward`` (a hook on each) runs just before it."""
    leaves, spec = tree_flatten(output)
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    for i, wrapped in zip(tensors, group.register_pre_backward([leaves[i] for i in tensors], prefetch)):
        if on_backward is not None and wrapped.requires_grad:
            wrapped.register_hook(on_backward)
        leaves[i] = wrapped
    return tree_unflatten(leaves, spec)


def cast_outputs(output, mp_policy: MixedPrecisionPolicy):
    """``output`` (any nesting) with floating tensors cast to output_dtype, if the policy has one."""
    if mp_policy.output_dtype is None:
        return output
    return tree_map(lambda a: _carry_tag(a, a.to(mp_policy.output_dtype))
                    if isinstance(a, torch.Tensor) and a.is_floating_point() else a, output)


def cast_inputs(inputs, mp_policy: MixedPrecisionPolicy):
    """``inputs`` (any nesting) with floating tensors cast to param_dtype; None if the policy
    casts nothing."""
    if mp_policy.param_dtype is None or not mp_policy.cast_forward_inputs:
        return None
    return tree_map(lambda a: _carry_tag(a, a.to(mp_policy.param_dtype))
                    if isinstance(a, torch.Tensor) and a.is_floating_point() else a, inputs)


def _carry_tag(source: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``result`` (an alias or a cast of ``source``), tagged with ``source``'s layout if a
    tensor-parallel style tagged it (``use_local_output=False``): the next style reads it."""
    return _C.DTensor.carry_tag(source, result)


class _Standing:
    """What the owning modules hold in ``_parameters`` for the group's parameters: the gathered
    ones during a call of the group; between calls the shards, except while the backward of the
    module fully_shard was applied to runs (from its outputs' gradients to its inputs', or to the
    end of the backward: FSDP2's pre- and post-backward), where they hold views of the gathered
    parameters, so a checkpointed region whose recomputation reads a parameter itself
    (``self.wpe.weight[:T]``, outside every module's forward) reads it whole."""

    def __init__(self, group, owners):
        self._group = group
        self._slots = [(mod, name, index) for mod, names in owners.items() for name, index in names]
        self._backward_views = None
        self._stood = None  # the tensors stood in last
        self.shards_in_place = True  # the owners hold the shards (no call or backward of the group)

    def index_of(self, module: nn.Module, name: str):
        """The group's index of ``module``'s parameter ``name``, or None if the group has none."""
        return next((index for mod, n, index in self._slots if mod is module and n == name), None)

    def stand_in(self, tensors, shards: bool = False) -> None:
        """The owners hold ``tensors``. The same gathered ones again (an owner's call inside the
        group's) are left as they stand: a tensor-parallel style's summing node stood in over one
        by a module whose forward is still running stays."""
        if not shards and not self.shards_in_place and self._stood is not None and len(tensors) == len(self._stood) \
                and all(new is old for new, old in zip(tensors, self._stood)):
            return
        self._stood = list(tensors)
        for mod, name, index in self._slots:
            mod._parameters[name] = tensors[index]
            # An RNN reads its weights from a list its __setattr__ keeps (FSDP2 sets them through it).
            if isinstance(mod, nn.RNNBase) and name in mod._flat_weights_names:
                mod._flat_weights[mod._flat_weights_names.index(name)] = tensors[index]
        self.shards_in_place = shards

    def adopt_replaced(self) -> None:
        """With the shards in place (otherwise nothing): a parameter a holder now has in their
        stead (torch's conversions from meta to cpu, to_empty, or any with torch.__future__'s
        overwrite flag, also on a holder alone) is the group's from then on, in every module
        holding it (a tied one, converted once per holder, keeps one tensor). A cast in place
        (to(dtype)) keeps the tensor: the next gather follows its dtype. Only a Parameter replaces
        one: a tensor a hook stands in for a call (a tensor-parallel style's summing node) does not."""
        if not self.shards_in_place:
            return
        current, replaced = self._group.parameters, {}
        for mod, name, index in self._slots:
            param = mod._parameters.get(name)
            if isinstance(param, nn.Parameter) and param is not current[index]:
                replaced.setdefault(index, param)
        if not replaced:
            return
        self._group.reshard()  # gathered from the tensors replaced
        for index, param in replaced.items():
            self._group.adopt_parameter(index, param)
            for mod, name, i in self._slots:
                if i == index:
                    mod._parameters[name] = param

    def put_back(self) -> None:
        """The end of the group's outermost call: the shards, or in its backward the views."""
        if self._backward_views is None:
            self.stand_in(self._group.parameters, shards=True)
        else:
            self.stand_in(self._backward_views)

    def begin_backward(self, grad) -> None:
        """A hook on the sharded module's outputs: its backward begins."""
        del grad
        if self._backward_views is not None:
            return
        views = self._group.backward_views()
        if not views:  # a row-sparse group, or a backward inside one of the group's calls
            return
        self._backward_views = views
        self.stand_in(views)
        torch.autograd.Variable._execution_engine.queue_callback(_AtEndOfBackward(self.end_backward))

    def end_backward(self) -> None:
        """The sharded module's backward is over (its inputs' gradients are computed), or the
        backward is."""
        if self._backward_views is None:
            return
        self._backward_views = None
        self.stand_in(self._group.parameters, shards=True)
        self._group.release_backward_views()

    def with_post_backward(self, args, kwargs):
        """The sharded module's inputs that need gradients, through one node whose backward (once
        all their gradients are computed) ends its backward. Only tensors passed directly are
        replaced (the lists and dicts the module gets stay the caller's); if one inside a
        container needs a gradient, there is no node, and the end of the backward ends it."""
        if not torch.is_grad_enabled():
            return args, kwargs
        direct = [a for a in (*args, *kwargs.values()) if _needs_grad(a)]
        if not direct or len(direct) != sum(map(_needs_grad, tree_flatten((args, kwargs))[0])):
            return args, kwargs
        passed = iter(map(_carry_tag, direct, _PostBackward.apply(self, *direct)))
        args = tuple(next(passed) if _needs_grad(a) else a for a in args)
        kwargs = {k: next(passed) if _needs_grad(v) else v for k, v in kwargs.items()}
        return args, kwargs


def _needs_grad(value) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


class _PostBackward(torch.autograd.Function):
    """The identity on a module's inputs; its backward runs once their gradients are all
    computed: the module's backward is over. Its outputs are detached aliases, not views, so the
    module may still write its inputs in place (``x.relu_()``)."""

    @staticmethod
    def forward(ctx, standing, *inputs):  # pylint: disable=arguments-differ
        ctx.standing = standing
        return tuple(t.detach() for t in inputs)

    @staticmethod
    def backward(ctx, *grads):  # pylint: disable=arguments-differ
        ctx.standing.end_backward()
        return (None, *grads)


class _AtEndOfBackward:
    """A callback queued on the backward running now: it runs at its end, or, if the backward
    fails, is dropped with its graph unrun, and runs then (the shards must not stay out)."""

    def __init__(self, end):
        self._end = end

    def __call__(self) -> None:
        end, self._end = self._end, None
        end()

    def __del__(self):
        if self._end is not None:
            self.__call__()


def _register_pre_hook_first(module: nn.Module, hook) -> None:
    """Ahead of the module's forward pre-hooks registered before fully_shard, as FSDP2's
    (``prepend=True``, which torch 1.13 lacks), so they read the whole parameters (weight_norm's
    recomputes its weight from them). Only the gather: the inputs are cast after those hooks, so
    that a tensor-parallel style's hook reads the layout its producer tagged (a cast is a new,
    untagged tensor). The sharded module's __call__ ends the call if a later pre-hook raises."""
    handle = module.register_forward_pre_hook(hook)
    module._forward_pre_hooks.move_to_end(handle.id, last=False)


def install_hooks(group, owners, mp_policy: MixedPrecisionPolicy, callers: dict):
    """The module fully_shard was applied to gathers the group for its whole forward and stands
    the gathered parameters in for the shards in every owning module's ``_parameters``, so a read
    outside an owner's own forward (a tied head's ``emb.weight``, a sliced position table,
    MultiheadAttention's ``out_proj``) is whole; its end registers the pre-backward on its outputs,
    ends the pass and puts the shards back (views of the gathered parameters during the group's
    backward, see _Standing). Each other owning module has hooks of its own for a call outside
    that forward (checkpoint's recomputation in the backward, a direct call), which stand in the
    whole group too; inside it they reuse its parameters. ``callers``: that module, or a list's
    modules (the modules in a container of it), each -> the module of the call whose prefetch
    lists it follows; a list's modules each have the module's hooks, but as users of the group:
    the first to run gathers it, and the pass ends once each has run (the group's user count).
    Returns what stands in the owners' ``_parameters``."""
    standing = _Standing(group, owners)
    alone = len(callers) == 1
    first_call = next(iter(callers.values()))

    def hooks(module, sharded_module):
        on_backward = standing.begin_backward if module in callers else None
        call = callers.get(module, first_call)

        def gather(mod, args):
            standing.adopt_replaced()
            # An embedding's forward reads the rows of its ids (a row-sparse group gathers those).
            ids = args[0] if isinstance(mod, nn.Embedding) and args and isinstance(args[0], torch.Tensor) else None
            standing.stand_in(group.pre_forward(ids, getattr(call, "_fsdp_forward_prefetch", []),
                                                sharded_module=sharded_module))

        def pre_hook(mod, args):
            gather(mod, args)
            return cast_inputs(args, mp_policy)

        def post_hook(mod, args, output):
            output = _with_pre_backward(group, output, getattr(call, "_fsdp_backward_prefetch", []), on_backward)
            if group.post_forward(sharded_module=sharded_module):
                standing.put_back()
            # As FSDP2's: the outputs of a module fully_shard was applied to, after the pre-backward.
            return output if module not in callers else cast_outputs(output, mp_policy)

        return gather, pre_hook, post_hook

    for sub in owners:
        if sub not in callers:
            _install(sub, *hooks(sub, sharded_module=False), mp_policy)
    for module in callers:
        _install(module, *hooks(module, sharded_module=alone), mp_policy)
    return standing


def _install(module: nn.Module, gather, pre_hook, post_hook, mp_policy: MixedPrecisionPolicy) -> None:
    if isinstance(module, nn.Embedding):
        # Its gather may read the ids (row-sparse): the ones the module's other pre-hooks give.
        module.register_forward_pre_hook(pre_hook)
    else:
        _register_pre_hook_first(module, gather)
        module.register_forward_pre_hook(lambda mod, args: cast_inputs(args, mp_policy))
    module.register_forward_hook(post_hook)
