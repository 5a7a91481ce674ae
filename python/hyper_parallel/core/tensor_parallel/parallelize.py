"""parallelize_module: applies parallel styles to a torch.nn module tree. The plan's rules (glob
matching of keys against module paths and its warnings, the target descriptions, the ranks'
agreement on them) are the C++ core's, the same parallelize_module applies to C++ modules."""

from typing import Dict, Optional, Union

from torch import nn

from hyper_parallel import _C
from hyper_parallel.core.tensor_parallel.style import ParallelStyle, _core_mesh


def _targets(module: nn.Module, plan: Dict[str, ParallelStyle]):
    for key, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"parallelize_module: expected a ParallelStyle for plan key {key!r}, "
                            f"got {type(style).__name__}")
    entries = list(plan.items())
    modules = dict(module.named_modules(remove_duplicate=False))  # pre-order, the root as ""
    matches = _C.match_plan([(key, type(style).__name__) for key, style in entries], list(modules),
                            type(module).__name__)
    return [(fqn, modules[fqn], entries[i][1]) for i, fqn in matches]


def _describe(fqn: str, module: nn.Module, style: ParallelStyle) -> str:
    params = [(name, p.dtype, list(p.shape)) for name, p in module.named_parameters(recurse=style._lays_out_submodules)]
    return _C.describe_target(fqn, type(style).__name__, params)


def parallelize_module(
    module: nn.Module,
    device_mesh,
    parallelize_plan: Optional[Union[ParallelStyle, Dict[str, ParallelStyle]]] = None,
    *,
    src_data_rank: Optional[int] = 0,
) -> nn.Module:
    """Applies ``parallelize_plan`` (one style, or a dict of module-path glob -> style; ``""`` is
    the module itself) on a 1-d TP mesh (ours, or any mesh with ``get_group()`` and ``size()``)
    and returns the module. A key matching nothing, or an
    empty plan, is a warning. ``src_data_rank``: the TP rank whose parameter values are sharded
    (None: every rank shards its own copy, with no communication). Collective: every rank of the
    mesh calls it with the same model and plan, which is checked first."""
    device_mesh = _core_mesh(device_mesh)
    _C.check_tp_mesh("parallelize_module", device_mesh)
    if isinstance(parallelize_plan, ParallelStyle):
        targets = [("", module, parallelize_plan)]
    elif isinstance(parallelize_plan, dict) or parallelize_plan is None:
        targets = _targets(module, parallelize_plan or {})
        if not parallelize_plan:
            return module
    else:
        raise TypeError(f"parallelize_module: expected a ParallelStyle or a dict of them, got "
                        f"{type(parallelize_plan).__name__}")
    _C.check_plan_agrees([_describe(fqn, m, style) for fqn, m, style in targets], device_mesh)
    for fqn, m, style in targets:
        style.src_data_rank = src_data_rank
        m._hp_fqn = fqn or "the root module"  # errors raised when the layer runs name it
        try:
            style.apply(m, device_mesh)
        except Exception as error:
            error.add_note(f"while applying {type(style).__name__} to {fqn or 'the root module'}")
            raise
    return module
