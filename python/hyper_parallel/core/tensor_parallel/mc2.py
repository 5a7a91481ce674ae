"""MC2Linear: a torch.nn.Linear whose forward is an MC2 fused op of the C++ core.

``MC2Linear.from_linear(linear)`` converts in place: the same object and the same Parameters,
now an MC2Linear (``isinstance`` holds). ``configure_mc2`` chooses the fused op:
``"all_gather"`` (column-parallel: input sharded on the sequence, output features sharded) or
``"reduce_scatter"`` (row-parallel: input features sharded, output sharded on the sequence).
The forward, its contract checks and its backward (each op's backward runs its dual) are the C++
core's.
"""

from typing import Optional

from torch import nn

from hyper_parallel import _C

MC2Contract = _C.MC2Contract
MC2Options = _C.MC2Options


class MC2Linear(nn.Linear):
    """A torch.nn.Linear running an MC2 fused op. Make one with from_linear."""

    mc2_mode: Optional[str] = None
    mc2_group = None
    mc2_world_size: Optional[int] = None
    mc2_sequence_dim: Optional[int] = None

    def __init__(self, *args, **kwargs):
        raise TypeError("MC2Linear: convert an existing torch.nn.Linear with MC2Linear.from_linear(linear)")

    @classmethod
    def from_linear(cls, linear: nn.Module) -> "MC2Linear":
        """Converts ``linear`` in place (same object, same Parameters) and returns it."""
        if isinstance(linear, MC2Linear):
            return linear
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"MC2Linear.from_linear: expected a torch.nn.Linear, got {type(linear).__name__}")
        linear.__class__ = cls
        linear._mc2 = _C.MC2LinearState()
        return linear

    def configure_mc2(self, mode: str, group: _C.Group, world_size: int, sequence_dim: int,
                      contract: Optional[MC2Contract] = None, options: Optional[MC2Options] = None) -> None:
        """Runs ``mode``'s fused op over ``group`` (of ``world_size`` ranks) on activations whose
        sequence is dim ``sequence_dim``."""
        if world_size != group.size():
            raise ValueError(f"MC2Linear.configure_mc2: expected world_size to equal the group's size "
                             f"({group.size()}), got {world_size}")
        self._mc2.configure_mc2(mode, group, sequence_dim, contract or MC2Contract.strict(),
                                options or MC2Options())
        self.mc2_mode, self.mc2_group = mode, group
        self.mc2_world_size, self.mc2_sequence_dim = world_size, sequence_dim

    @property
    def is_configured(self) -> bool:
        return self._mc2.is_configured

    def forward(self, input):
        return self._mc2.forward(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        mc2 = f"mc2_mode={self.mc2_mode}, mc2_world_size={self.mc2_world_size}" if self.is_configured else "unconfigured"
        return f"{super().extra_repr()}, {mc2}"
