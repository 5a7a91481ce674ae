"""Summed reads: a style's parameters whose gradient is Partial (each rank's forward saw its own
tokens) are read, through each call, as the core's sum_gradient_on_read of what their module
holds, so the gradient of the forward is summed over the mesh and a loss term on the parameter
itself is not.

The parameters may be the styled module's own or its submodules' (SequenceParallel lays out a
whole subtree, as torch's does). The styled module stands a node in for each of them as its
forward starts, which also covers a forward that reads a submodule's parameter itself; each
submodule holding some stands one in again as its own forward starts, over what its forward
pre-hooks stood in (fully_shard's gather of that submodule). A node is never stood in over
another, so each read is summed once.
"""

from typing import Dict, List

import torch
from torch import nn

from hyper_parallel import _C
from hyper_parallel.core.tensor_parallel.forward_wrap import wrap_forward

_MARK = "_hp_summed_read"  # set on each node stood in


def sum_gradients_of_reads(module: nn.Module, names, mesh) -> None:
    """Installs the summed reads of ``names`` (as ``module.named_parameters()`` names them) on
    ``module`` and on each submodule holding some. Each stands them in as its forward starts,
    over whatever its forward pre-hooks stood in, and puts them back, where they still stand,
    when its forward returns or raises. A module with pre-hooks registered before the style (a
    weight_norm's computes the weight from the parameters) also stands them in from a pre-hook
    ahead of those; if a later pre-hook raises, they are put back at the next call. Parameters
    tied into several places of the subtree are read through a node in each."""
    if not names:
        return
    names = set(names)
    wanted = {id(param) for name, param in module.named_parameters() if name in names}
    by_owner: Dict[str, List[str]] = {}  # submodule path ("" the module) -> its parameters' names
    for path, owner in module.named_modules():  # a submodule at several paths: once
        leaves = [leaf for leaf, param in owner._parameters.items() if param is not None and id(param) in wanted]
        if leaves:
            by_owner.setdefault(path, leaves)
    style = module._hp_sharding_style
    laid_out = {path: set(module.get_submodule(path)._parameters) for path in by_owner}
    _install(module, by_owner, laid_out, style, mesh)
    for path in by_owner:
        if path:
            owner = module.get_submodule(path)
            owner._hp_sharding_style = style
            _install(owner, {"": by_owner[path]}, {"": laid_out[path]}, style, mesh)


def _install(module: nn.Module, by_owner, laid_out, style: str, mesh) -> None:
    # Nothing here refers to a module (a deep copy's hooks act on the copy); what a call stood
    # in lives on the module itself.
    module._hp_read_nodes = []  # (owner, name, what it held before, the node stood in), in order

    def stand_in(mod):
        for path, names in by_owner.items():
            owner = mod.get_submodule(path)
            if torch.is_grad_enabled():
                _check_parameters_laid_out(style, owner, names, laid_out[path])
            _stand_in_reads(mod, owner, names, mesh)

    def stand_in_ahead(mod, args):
        _put_back_reads(mod)  # what a call whose later pre-hook raised left
        stand_in(mod)

    if module._forward_pre_hooks:
        handle = module.register_forward_pre_hook(stand_in_ahead)
        module._forward_pre_hooks.move_to_end(handle.id, last=False)

    def forward_reading_through_the_sums(mod, forward, *args, **kwargs):
        try:
            stand_in(mod)
            return forward(*args, **kwargs)
        finally:
            _put_back_reads(mod)

    wrap_forward(module, forward_reading_through_the_sums)


def _stand_in_reads(module: nn.Module, owner: nn.Module, names, mesh) -> None:
    """Each of ``owner``'s ``names`` not holding a node already: its node, over what it holds."""
    for name in names:
        held = owner._parameters.get(name)
        if held is None or getattr(held, _MARK, False):
            continue
        node = _C.sum_gradient_on_read(held, mesh)
        if node is held:  # nothing to sum (no grad, a frozen parameter, one rank): nothing stands in
            continue
        setattr(node, _MARK, True)
        module._hp_read_nodes.append((owner, name, held, node))
        owner._parameters[name] = node


def _put_back_reads(module: nn.Module) -> None:
    """What each node ``module`` stood in stood in for, where the node still stands (newest first)."""
    records = module._hp_read_nodes
    for owner, name, held, node in reversed(records):
        if owner._parameters.get(name) is node:
            owner._parameters[name] = held
    records.clear()


def _check_parameters_laid_out(style: str, module: nn.Module, names, laid_out) -> None:
    """A parameter registered after the style, or one of ``names`` that now is a computed tensor
    (weight_norm, parametrize after the style), would get this rank's part of its gradient only."""
    added = sorted(set(module._parameters) - laid_out)
    computed = [name for name in names if name not in module._parameters and (
        name in module.__dict__ or isinstance(getattr(type(module), name, None), property))]
    if added or computed:
        what = f"'{added[0]}' registered after it" if added else f"'{computed[0]}' now computed from other tensors"
        raise ValueError(f"{style}: expected {type(module).__name__}'s parameters to be those it laid out "
                         f"({', '.join(sorted(laid_out))}), got {what}, whose gradient would be this rank's part "
                         "only (apply weight_norm before the style; parametrize is not supported)")
