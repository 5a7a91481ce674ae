"""MC2 (matmul + communication) fused linear primitives for tensor parallelism, with the original
system's interface: the autograd Functions, ``get_hcomm_info``, ``MC2Linear`` and the sequence
helpers.

The two fused operations are duals (docs/mc2.md):

* ``AllGatherMatmulFunction``      forward:  ``Y = AllGather_rows(X) @ Wᵀ + b``
                                   backward: ``dX = matmul_reduce_scatter(dY, W)``, ``dW = dYᵀ G``
* ``MatmulReduceScatterFunction``  forward:  ``Y = ReduceScatter_rows(X @ Wᵀ) + b``
                                   backward: ``dX, dY_full = all_gather_matmul(dY, W)``,
                                   ``dW = dY_fullᵀ X``

Both run on local 2-d tensors (rows, features), ``W`` in ``nn.Linear``'s (out, in) layout, over a
``torch.distributed`` ProcessGroup (or the core's Group). Their forward and backward are each one
call into the C++ core, the very passes MC2Linear's autograd runs: the fused ops overlap the
transfers of the collective with the matmul, portably, over point-to-point transfers.
"""

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel import _C

MC2Contract = _C.MC2Contract
MC2Options = _C.MC2Options

__all__ = [
    "get_hcomm_info",
    "AllGatherMatmulFunction",
    "MatmulReduceScatterFunction",
    "MC2Linear",
]


def get_hcomm_info(group) -> str:
    """The name of the communicator the C++ core uses for ``group`` (a torch.distributed
    ProcessGroup): non-empty and equal on every rank of the group, e.g. ``"world"`` or
    ``"torch:3[0, 1]"`` (torch's name for the group, then its global ranks). The original
    returns the HCCL communicator's name here."""
    return _C.get_hcomm_info(group)


def _normalize_sequence_dim(sequence_dim: int, ndim_leading: int) -> int:
    """``sequence_dim`` among ``ndim_leading`` leading dims; negative counts from their end.
    Out of range: RuntimeError."""
    return _C.normalize_sequence_dim(sequence_dim, ndim_leading)


def _move_dim_to_front(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """``dim`` moved to the front, the other dims in order; contiguous."""
    return _C.move_dim_to_front(tensor, dim)


def _move_front_to_dim(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of :func:`_move_dim_to_front`."""
    return _C.move_front_to_dim(tensor, dim)


class AllGatherMatmulFunction(torch.autograd.Function):
    """Column-parallel fused all-gather + matmul: ``.apply(x, w, group, world_size, bias)``,
    x (rows, k) this rank's rows, w (n_local, k), bias (n_local,) or None."""

    @staticmethod
    def forward(ctx, x, w, group, world_size, bias=None):  # pylint: disable=arguments-differ
        out, gathered = _C.mc2_column_forward(x, w, bias, group, world_size)
        ctx.save_for_backward(gathered, w)
        ctx.group = group
        ctx.x_layout = (x.shape, x.stride())
        return out

    @staticmethod
    def backward(ctx, grad_out):  # pylint: disable=arguments-differ
        gathered, w = ctx.saved_tensors
        need_x, need_w, _, _, need_b = ctx.needs_input_grad
        grad_x, grad_w, grad_b = _C.mc2_column_backward(grad_out, None, gathered, w, ctx.group, MC2Options(),
                                                        need_x, need_w, need_b)
        # Each gradient in its input's memory layout (docs/known-torch-bugs.md).
        return (_C.gradient_in_layout(grad_x, *ctx.x_layout), _C.gradient_in_layout(grad_w, w.shape, w.stride()),
                None, None, grad_b)


class MatmulReduceScatterFunction(torch.autograd.Function):
    """Row-parallel fused matmul + reduce-scatter: ``.apply(x, w, group, world_size, bias)``,
    x (rows, k_local) all rows, w (n, k_local), bias (n,) or None; rows divisible by world_size."""

    @staticmethod
    def forward(ctx, x, w, group, world_size, bias=None):  # pylint: disable=arguments-differ
        out = _C.mc2_row_forward(x, w, bias, group, world_size)
        ctx.save_for_backward(x, w)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad_out):  # pylint: disable=arguments-differ
        x, w = ctx.saved_tensors
        need_x, need_w, _, _, need_b = ctx.needs_input_grad
        grad_x, grad_w, grad_b = _C.mc2_row_backward(grad_out, x, w, ctx.group, MC2Options(), need_x, need_w, need_b)
        return (_C.gradient_in_layout(grad_x, x.shape, x.stride()), _C.gradient_in_layout(grad_w, w.shape, w.stride()),
                None, None, grad_b)


class MC2Linear(nn.Linear):
    """A torch.nn.Linear whose forward is an MC2 fused op of the C++ core, once configured.

    ``MC2Linear.from_linear(linear)`` converts in place: the same object and the same Parameters,
    now an MC2Linear (``isinstance`` holds). ``configure_mc2(mode, group, world_size,
    sequence_dim=0)`` chooses the fused op, ``"all_gather"`` (column-parallel: input sharded on
    the sequence, output features sharded) or ``"reduce_scatter"`` (row-parallel: input features
    sharded, output sharded on the sequence). As in the original, the group handle is kept as
    given and used when the layer first runs (a torch.distributed ProcessGroup or the core's
    Group; anything else is then an error naming the layer). The C++ core runs the forward, the
    contract's checks (the dtype limit each time the layer runs) and the backward.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _init_mc2_state(self)

    @classmethod
    def from_linear(cls, linear: nn.Module) -> "MC2Linear":
        """Converts ``linear`` in place (same object, same Parameters) and returns it."""
        if isinstance(linear, MC2Linear):
            return linear
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"MC2Linear.from_linear: expected a torch.nn.Linear, got {type(linear).__name__}")
        linear.__class__ = cls
        _init_mc2_state(linear)
        return linear

    def configure_mc2(self, mode: str, group, world_size: int, sequence_dim: int = 0,
                      contract: Optional[MC2Contract] = None, options: Optional[MC2Options] = None) -> None:
        """Runs ``mode``'s fused op over ``group`` (a torch.distributed ProcessGroup of
        ``world_size`` ranks) on activations whose sequence is leading dim ``sequence_dim``
        (negative counts from the end of the leading dims). A mode other than the two, a world
        size the contract excludes, or one other than a ProcessGroup's own size is a ValueError
        now; a handle of another kind is kept and resolved when the layer first runs. A failed
        call changes nothing."""
        config = (_C.mc2_mode_from_string(mode), group, world_size, sequence_dim, contract or MC2Contract.strict(),
                  options or MC2Options())
        config[4].check_world_size("MC2Linear.configure_mc2", world_size)
        state = _configured_state(config, getattr(self, "_hp_fqn", "")) if _is_group(group) else None
        self._mc2_config, self._mc2 = config, state

    @property
    def is_configured(self) -> bool:
        return self._mc2_config is not None

    @property
    def mc2_mode(self) -> Optional[str]:
        return self._mc2_config[0] if self._mc2_config else None

    @property
    def mc2_group(self):
        """The group handle configure_mc2 was given."""
        return self._mc2_config[1] if self._mc2_config else None

    @property
    def mc2_world_size(self) -> Optional[int]:
        return self._mc2_config[2] if self._mc2_config else None

    @property
    def mc2_sequence_dim(self) -> Optional[int]:
        return self._mc2_config[3] if self._mc2_config else None

    def _state(self):
        """The core's MC2Linear, configured on first use with the handle configure_mc2 kept."""
        if self._mc2 is None:
            label = getattr(self, "_hp_fqn", "")
            if self._mc2_config is None:
                self._mc2 = _C.MC2LinearState()  # not configured: its forward is a plain Linear
                return self._mc2
            try:
                self._mc2 = _configured_state(self._mc2_config, label)
            except (TypeError, ValueError) as error:
                name = repr(label) if label else f"(in_features={self.in_features}, out_features={self.out_features})"
                raise type(error)(f"MC2Linear {name}: the group given to configure_mc2 cannot run the fused op: "
                                  f"{error}") from error
        return self._mc2

    def forward(self, input):  # pylint: disable=redefined-builtin
        return self._state().forward(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        mc2 = (f"mc2_mode={self.mc2_mode}, mc2_world_size={self.mc2_world_size}" if self.is_configured
               else "unconfigured")
        return f"{super().extra_repr()}, {mc2}"


def _init_mc2_state(linear: nn.Module) -> None:
    linear._mc2_config = None
    linear._mc2 = None


def _is_group(handle) -> bool:
    return isinstance(handle, (dist.ProcessGroup, _C.Group))


def _configured_state(config, label: str):
    """The core's MC2Linear for a configure_mc2 call's arguments (the core checks them)."""
    mode, group, world_size, sequence_dim, contract, options = config
    state = _C.MC2LinearState()
    state.configure_mc2(mode, group, world_size, sequence_dim, contract, options)
    state.set_label(label or "")
    return state
