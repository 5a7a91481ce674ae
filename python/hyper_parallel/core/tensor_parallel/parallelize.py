"""parallelize_module: applies parallel styles to a torch.nn module tree."""

import fnmatch
import warnings
from typing import Dict, List, Optional, Tuple, Union

from torch import nn

from hyper_parallel import _C
from hyper_parallel.core.tensor_parallel.style import ParallelStyle


def _matching(module: nn.Module, prefix: str, tokens: List[str]) -> List[Tuple[str, nn.Module]]:
    if not tokens:
        return [(prefix, module)]
    found = []
    for name, child in module.named_children():
        if fnmatch.fnmatchcase(name, tokens[0]):
            found += _matching(child, f"{prefix}.{name}" if prefix else name, tokens[1:])
    return found


def _describe(fqn: str, module: nn.Module, style: ParallelStyle) -> str:
    params = " ".join(f"{n} {str(p.dtype).replace('torch.', '')}{list(p.shape)}"
                      for n, p in module.named_parameters(recurse=False))
    return f"{fqn or '(root)'}: {type(style).__name__} {params}".rstrip()


def parallelize_module(
    module: nn.Module,
    device_mesh: _C.DeviceMesh,
    parallelize_plan: Optional[Union[ParallelStyle, Dict[str, ParallelStyle]]] = None,
    *,
    src_data_rank: Optional[int] = 0,
) -> nn.Module:
    """Applies ``parallelize_plan`` (one style, or a dict of module-path glob -> style; ``""`` is
    the module itself) on a 1-d TP mesh and returns the module. A key matching nothing, or an
    empty plan, is a warning. ``src_data_rank``: the TP rank whose parameter values are sharded
    (None: every rank shards its own copy, with no communication). Collective: every rank of the
    mesh calls it with the same model and plan, which is checked first."""
    _C.check_tp_mesh("parallelize_module", device_mesh)
    if isinstance(parallelize_plan, ParallelStyle):
        targets = [("", module, parallelize_plan)]
    elif isinstance(parallelize_plan, dict) or parallelize_plan is None:
        if not parallelize_plan:
            warnings.warn(f"parallelize_module: the plan is empty; nothing in {type(module).__name__} is parallelized")
            return module
        targets = []
        for key, style in parallelize_plan.items():
            if not isinstance(style, ParallelStyle):
                raise TypeError(f"parallelize_module: expected a ParallelStyle for plan key {key!r}, "
                                f"got {type(style).__name__}")
            tokens = key.split(".") if key else []
            if any(not t for t in tokens):
                raise ValueError(f"parallelize_module: expected plan key tokens separated by single dots, got {key!r}")
            found = _matching(module, "", tokens)
            if not found:
                warnings.warn(f"parallelize_module: plan key {key!r} ({type(style).__name__}) matched no submodule "
                              f"of {type(module).__name__}")
            targets += [(fqn, m, style) for fqn, m in found]
    else:
        raise TypeError(f"parallelize_module: expected a ParallelStyle or a dict of them, got "
                        f"{type(parallelize_plan).__name__}")
    _C.check_plan_agrees([_describe(fqn, m, style) for fqn, m, style in targets], device_mesh)
    for fqn, m, style in targets:
        style.src_data_rank = src_data_rank
        try:
            style._apply(m, device_mesh)
        except Exception as error:
            error.add_note(f"while applying {type(style).__name__} to {fqn or 'the root module'}")
            raise
    return module
