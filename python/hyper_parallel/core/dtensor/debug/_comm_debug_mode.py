"""CommDebugMode: the collectives a block of code ran, in the shape of torch's
``torch.distributed.tensor.debug.CommDebugMode`` and the original's. The C++ core counts every
collective by kind (``hyper_parallel.core.comm.collective_count``); this reads those counters
when the block begins and ends, and around the forward of each submodule of ``module``.

The counters are the process's: collectives of other threads while the block runs (an
asynchronous checkpoint's writer) count too, and ``reset_collective_counts()`` inside the block
makes its counts start again from there.
"""

import json
from typing import Any, Dict, List, Optional, Tuple

from hyper_parallel import _C
from hyper_parallel.core.dtensor.placement_types import as_python

# The kinds the core counts for the program's collectives (its link probes are not the program's).
_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "barrier",
          "all_gather_matmul", "matmul_reduce_scatter")


def _counts() -> Dict[str, int]:
    return {kind: _C.collective_count(kind) for kind in _KINDS}


def _since(start: Dict[str, int], now: Dict[str, int]) -> Dict[str, int]:
    """The kinds that ran between two readings, with their counts (a reset in between: from it)."""
    ran = {}
    for kind in _KINDS:
        count = now[kind] - start[kind] if now[kind] >= start[kind] else now[kind]
        if count:
            ran[kind] = count
    return ran


class CommDebugMode:
    """Counts the collectives a block runs, by kind; with ``module``, also those of each
    submodule's forward (its own and its children's), and the module's parameters and layouts.

    Usage::

        with CommDebugMode(module=model) as comm_mode:
            model(x).sum().backward()
        comm_mode.get_comm_counts()      # {"all_gather": 4, "reduce_scatter": 4}
        print(comm_mode.generate_comm_debug_tracing_table(noise_level=1))
    """

    def __init__(self, module=None):
        self._module = module
        self._start: Optional[Dict[str, int]] = None
        self._end: Optional[Dict[str, int]] = None
        self._open: List[Tuple[str, int, Dict[str, int]]] = []  # forwards under way: fqn, depth, start
        self._forwards: List[Tuple[str, int, Dict[str, int]]] = []  # in order of entry: fqn, depth, counts
        self._handles = []

    def __enter__(self):
        if self._start is not None and self._end is None:
            raise RuntimeError("CommDebugMode: expected a block not already open on this instance, got one open "
                               "(make another CommDebugMode to nest)")
        self._start, self._end = _counts(), None
        self._open.clear()
        self._forwards.clear()
        if self._module is not None:
            for fqn, sub in self._module.named_modules():
                name = fqn or "(root)"
                self._handles.append(sub.register_forward_pre_hook(lambda m, a, name=name: self._enter(name)))
                self._handles.append(sub.register_forward_hook(lambda m, a, o, name=name: self._exit(name)))
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        self._end = _counts()
        while self._open:  # forwards that raised out of the block: closed with it
            self._close_innermost()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __repr__(self) -> str:
        return f"CommDebugMode(get_total_counts()={self.get_total_counts()})"

    def _enter(self, name: str) -> None:
        self._forwards.append((name, len(self._open), {}))
        self._open.append((name, len(self._forwards) - 1, _counts()))

    def _close_innermost(self) -> str:
        opened, index, start = self._open.pop()
        fqn, depth, _ = self._forwards[index]
        self._forwards[index] = (fqn, depth, _since(start, _counts()))
        return opened

    def _exit(self, name: str) -> None:
        # A forward that raised (and whose exception its caller caught) left its entry open: it
        # closes here, with its caller, and is credited with what ran until then.
        while self._open:
            if self._close_innermost() == name:
                return

    def get_comm_counts(self) -> Dict[str, int]:
        """The collectives run so far in the block (or in it, once it is over), by kind."""
        if self._start is None:
            return {}
        return _since(self._start, self._end if self._end is not None else _counts())

    def get_total_counts(self) -> int:
        """How many collectives the block ran."""
        return sum(self.get_comm_counts().values())

    def get_parameter_info(self) -> Dict[str, Dict[str, Any]]:
        """Per module of ``module`` holding parameters: ``{param_name: param.data}``."""
        info = {}
        for fqn, sub in (self._module.named_modules() if self._module is not None else ()):
            params = {name: p.data for name, p in sub.named_parameters(recurse=False)}
            if params:
                info[fqn or "(root)"] = params
        return info

    def get_sharding_info(self) -> Dict[str, Any]:
        """Per parameter a style or fully_shard laid out: ``{fqn: placements}``."""
        info = {}
        for fqn, param in (self._module.named_parameters() if self._module is not None else ()):
            layout = _C.layout_of(param)
            if layout is not None:
                info[fqn] = tuple(as_python(p) for p in layout[1])
        return info

    def _rows(self, noise_level: int) -> List[Tuple[str, int, Dict[str, int]]]:
        rows = [("(block)", 0, self.get_comm_counts())]
        if noise_level >= 1:
            rows += [(fqn, depth + 1, counts) for fqn, depth, counts in self._forwards if counts or noise_level >= 2]
        return rows

    def generate_comm_debug_tracing_table(self, noise_level: Optional[int] = None) -> str:
        """0: the block's collectives by kind; 1 (the default): also each forward of a submodule
        that ran some (the forwards of ``module`` only); 2: every forward."""
        noise_level = 1 if noise_level is None else noise_level
        lines = [f"{'Where':<48} Collectives", "-" * 80]
        for where, depth, counts in self._rows(noise_level):
            ran = ", ".join(f"{kind} x{n}" for kind, n in counts.items()) or "none"
            lines.append(f"{'  ' * depth + where:<48} {ran}")
        return "\n".join(lines)

    def log_comm_debug_tracing_table_to_file(self, file_name: str = "comm_mode_log.txt",
                                             noise_level: Optional[int] = None) -> None:
        """generate_comm_debug_tracing_table, written to ``file_name``."""
        with open(file_name, "w", encoding="utf-8") as f:
            f.write(self.generate_comm_debug_tracing_table(noise_level) + "\n")

    def generate_json_dump(self, file_name: str = "comm_mode_log.json", noise_level: Optional[int] = None) -> None:
        """The table's rows as JSON: ``[{"where", "depth", "counts"}]``."""
        rows = self._rows(1 if noise_level is None else noise_level)
        with open(file_name, "w", encoding="utf-8") as f:
            json.dump([{"where": w, "depth": d, "counts": c} for w, d, c in rows], f, indent=2)
