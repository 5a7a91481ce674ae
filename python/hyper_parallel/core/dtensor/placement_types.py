"""Placements, spelled as torch.distributed.tensor's: Shard(dim), Replicate(), Partial().
Comparing a placement with anything that is not one is False (``x in [None, Shard(1)]``)."""

from hyper_parallel import _C

Placement = _C.Placement


class Shard(_C.Placement):
    """Each rank holds chunk ``coordinate`` of tensor dim ``dim`` (torch.chunk sizes)."""

    def __init__(self, dim: int):
        super().__init__("shard", dim)

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"


class Replicate(_C.Placement):
    """Each rank holds the whole value."""

    def __init__(self):
        super().__init__("replicate")

    def __repr__(self) -> str:
        return "Replicate()"


class Partial(_C.Placement):
    """The value is the sum (or mean) over ranks of the local tensors."""

    def __init__(self, reduce_op: str = "sum"):
        if reduce_op not in ("sum", "avg"):
            raise ValueError(f"Partial: expected reduce_op 'sum' or 'avg', got {reduce_op!r}")
        super().__init__("partial", 0, _C.ReduceOp.SUM if reduce_op == "sum" else _C.ReduceOp.AVG)

    @property
    def reduce_op(self) -> str:
        """torch's spelling, "sum" or "avg" (code compares it with those strings)."""
        return "sum" if _C.Placement.reduce_op.__get__(self) == _C.ReduceOp.SUM else "avg"

    def __repr__(self) -> str:
        return "Partial()" if self.reduce_op == "sum" else "Partial(avg)"


def as_python(placement: _C.Placement) -> Placement:
    """The placement as Shard / Replicate / Partial (C++ returns plain placements)."""
    if placement.is_shard():
        return Shard(placement.dim)
    if placement.is_replicate():
        return Replicate()
    # The core's field: a Python Partial spells reduce_op as a string.
    return Partial("sum" if _C.Placement.reduce_op.__get__(placement) == _C.ReduceOp.SUM else "avg")
