#!/usr/bin/env python3
"""The library's layers, at the level of includes: a file of the library (src/, include/) includes
only headers of its own layer or of the layers below it. The build enforces the same at link time
(the hp_layer_check_* libraries); this check also catches what a link cannot see, such as an
inline function or a template of a higher layer. Prints each offender as
path:line: layer includes header (layer) and exits 1 if there is any.

    layers.py [REPO_ROOT]

Layers, lowest first (docs/architecture.md): util; comm (with autograd); dtensor; nn; then,
beside each other, tensor_parallel, data_parallel, fully_shard and checkpoint. The umbrella
header hyper_parallel.h is above them all, and a layer's umbrella (core/comm.h, ...) is that
layer's.
"""

import re
import sys
from pathlib import Path

RANK = {"util": 0, "comm": 1, "autograd": 1, "dtensor": 2, "nn": 3,
        "tensor_parallel": 4, "data_parallel": 4, "fully_shard": 4, "checkpoint": 4, "umbrella": 5}
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def layer_of(path: Path, root: Path) -> str | None:
    """The layer of a file of the library, from its path; None outside the library."""
    parts = path.relative_to(root).with_suffix("").parts
    if parts[:2] == ("include", "hyper_parallel"):
        parts = parts[2:]
    elif parts[:1] == ("src",):
        parts = parts[1:]
    else:
        return None
    if parts in (("hyper_parallel",),):
        return "umbrella"
    if parts[:1] == ("checkpoint",):
        return "checkpoint"
    if parts[:1] == ("core",) and len(parts) >= 2:
        return "comm" if parts[1] == "autograd" else parts[1]
    return None


def allowed(user: str, used: str) -> bool:
    """Whether layer `user` may include a header of layer `used`: its own, or one below it."""
    if user == used or (user, used) in (("comm", "autograd"), ("autograd", "comm")):
        return True
    return RANK[used] < RANK[user]


def resolve(source: Path, bracket: str, name: str, root: Path) -> Path | None:
    if bracket == "<":
        return root / "include" / name if name.startswith("hyper_parallel/") else None
    candidate = (source.parent / name).resolve()
    return candidate if candidate.exists() else None


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[3]).resolve()
    offenders = []
    files = sorted(p for d in ("src", "include") for p in (root / d).rglob("*") if p.suffix in (".h", ".cpp"))
    for source in files:
        user = layer_of(source, root)
        if user is None:
            continue
        text = source.read_text()
        for match in INCLUDE.finditer(text):
            target = resolve(source, match.group(1), match.group(2), root)
            used = layer_of(target, root) if target is not None else None
            if used is not None and not allowed(user, used):
                line = text.count("\n", 0, match.start()) + 1
                offenders.append(f"{source.relative_to(root)}:{line}: {user} includes {match.group(2)} ({used})")
    for offender in offenders:
        print(offender)
    print(f"layers.py: {len(files)} files, {len(offenders)} includes of a higher or sibling layer")
    return 1 if offenders else 0


if __name__ == "__main__":
    sys.exit(main())
