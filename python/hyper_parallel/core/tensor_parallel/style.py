"""Parallel styles for torch.nn modules, with torch.distributed.tensor.parallel's defaults.

A style shards a module's parameters in place (the Parameter objects stay, so an optimizer made
before or after sees them) and redistributes its activations in forward (pre-)hooks. Every tensor
operation is one call into the C++ core (hyper_parallel._C), which also gives the backward.
Between modules tensors are local shards; ``use_local_output=False`` returns the local tensor
tagged with its layout, so the next style reads its placements (the C++ core's tag).
"""

import types
from typing import Optional, Sequence

from torch import nn

from hyper_parallel import _C
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard


class ParallelStyle:
    """Applied to one module by parallelize_module, which sets ``src_data_rank``: the TP rank
    whose parameter values are sharded (None: every rank shards its own copy)."""

    src_data_rank: Optional[int] = 0

    def _apply(self, module: nn.Module, device_mesh: _C.DeviceMesh) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} does not implement _apply")


def _claim(style: str, module: nn.Module) -> None:
    """A module's parameters and forward are changed by one sharding style only."""
    previous = getattr(module, "_hp_sharding_style", None)
    if previous is not None:
        raise ValueError(
            f"{style}: expected a module no style has parallelized yet, got {type(module).__name__} "
            f"already parallelized by {previous}"
        )
    module._hp_sharding_style = style


def _shard(param, mesh, placements, src_data_rank) -> None:
    if param is not None:
        _C.shard_tensor_in_place(param, mesh, list(placements), src_data_rank)


def _replace_first_input(convert):
    def hook(module, args):
        if not args:
            return None
        return (convert(args[0]),) + tuple(args[1:])

    return hook


class ColwiseParallel(ParallelStyle):
    """Linear weight and bias Shard(0), Embedding weight Shard(1); the input is made Replicate
    (a Shard input is all-gathered, its Partial gradient reduce-scattered); the output is
    Shard(-1) unless output_layouts says otherwise."""

    def __init__(self, *, input_layouts: Optional[Placement] = None, output_layouts: Optional[Placement] = None,
                 use_local_output: bool = True):
        self.input_layouts = input_layouts if input_layouts is not None else Replicate()
        self.output_layouts = output_layouts if output_layouts is not None else Shard(-1)
        self.use_local_output = use_local_output

    def _apply(self, module, device_mesh):
        name = type(self).__name__
        mesh, layout = device_mesh, self.input_layouts
        if isinstance(module, nn.Linear):
            _claim(name, module)
            _shard(module.weight, mesh, [Shard(0)], self.src_data_rank)
            _shard(module.bias, mesh, [Shard(0)], self.src_data_rank)
            module.register_forward_pre_hook(
                _replace_first_input(lambda x: _C.replicate_for_column(x, mesh, layout)))
        elif isinstance(module, nn.Embedding):
            _claim(name, module)
            _shard(module.weight, mesh, [Shard(1)], self.src_data_rank)
            module.register_forward_pre_hook(
                _replace_first_input(lambda ids: _C.prepare(ids, mesh, layout, Replicate(), True)))
        else:
            raise TypeError(f"{name}: expected torch.nn.Linear or torch.nn.Embedding, got {type(module).__name__}")
        out, local = self.output_layouts, self.use_local_output
        module.register_forward_hook(lambda m, args, y: _C.prepare(y, mesh, Shard(-1), out, local))
        return module


class RowwiseParallel(ParallelStyle):
    """Linear weight Shard(1), bias Replicate and added once after the reduction; Embedding
    weight Shard(0) over the vocabulary with a Replicate input. The local result is Partial:
    all-reduced to Replicate or reduce-scattered to a Shard output."""

    def __init__(self, *, input_layouts: Optional[Placement] = None, output_layouts: Optional[Placement] = None,
                 use_local_output: bool = True):
        self.input_layouts = input_layouts if input_layouts is not None else Shard(-1)
        self.output_layouts = output_layouts if output_layouts is not None else Replicate()
        self.use_local_output = use_local_output

    def _apply(self, module, device_mesh):
        name = type(self).__name__
        mesh, out, local = device_mesh, self.output_layouts, self.use_local_output
        if isinstance(module, nn.Linear):
            _claim(name, module)
            _shard(module.weight, mesh, [Shard(1)], self.src_data_rank)
            if module.bias is not None:
                _shard(module.bias, mesh, [Replicate()], self.src_data_rank)
                if out.is_shard():  # each rank then sees the bias gradient of its own rows only
                    _C.sum_gradient_over_mesh(module.bias, mesh)
            layout = self.input_layouts
            module.register_forward_pre_hook(
                _replace_first_input(lambda x: _C.prepare(x, mesh, layout, Shard(x.dim() - 1), True)))
            module.forward = types.MethodType(
                lambda self, x: _C.rowwise_linear(x, self.weight, self.bias, mesh, out, local), module)
        elif isinstance(module, nn.Embedding):
            if not self.input_layouts.is_replicate():
                raise ValueError(f"{name}: expected input_layouts Replicate for an Embedding (ids index the "
                                 f"whole vocabulary), got {self.input_layouts}")
            _claim(name, module)
            vocab = module.num_embeddings
            _shard(module.weight, mesh, [Shard(0)], self.src_data_rank)
            module.forward = types.MethodType(
                lambda self, ids: _C.rowwise_embedding(ids, self.weight, vocab, mesh, out, local), module)
        else:
            raise TypeError(f"{name}: expected torch.nn.Linear or torch.nn.Embedding, got {type(module).__name__}")
        return module


class SequenceParallel(ParallelStyle):
    """For modules that act on each token alone (norms, dropout): parameters stay replicated, the
    input is Shard(sequence_dim), no communication in forward or backward; parameter gradients
    (Partial) are summed over the mesh by a gradient hook."""

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def _apply(self, module, device_mesh):
        _claim(type(self).__name__, module)
        mesh, seq, local = device_mesh, Shard(self.sequence_dim), self.use_local_output
        for param in module.parameters(recurse=False):
            _shard(param, mesh, [Replicate()], self.src_data_rank)
            _C.sum_gradient_over_mesh(param, mesh)

        def pre_hook(m, args):
            return tuple(_C.prepare(x, mesh, seq, seq, True) if getattr(x, "is_floating_point", lambda: False)()
                         else x for x in args)

        module.register_forward_pre_hook(pre_hook)
        module.register_forward_hook(lambda m, args, y: _C.prepare(y, mesh, seq, seq, local))
        return module


def _check_lists(style: str, a_name: str, a: Sequence, b_name: str, b: Sequence) -> None:
    if len(a) != len(b):
        raise ValueError(f"{style}: expected {a_name} and {b_name} of the same length, got {len(a)} and {len(b)}")
    for i, (x, y) in enumerate(zip(a, b)):
        if (x is None) != (y is None):
            raise ValueError(f"{style}: expected {a_name}[{i}] and {b_name}[{i}] both set or both None")


def _convert_all(style, what, xs, mesh, src, dst, local):
    if len(xs) != len(src):
        raise ValueError(f"{style}: expected {len(src)} {what} (one per layout), got {len(xs)}")
    return tuple(x if s is None or x is None else _C.prepare(x, mesh, s, d, local)
                 for x, s, d in zip(xs, src, dst))


class PrepareModuleInput(ParallelStyle):
    """Converts each positional input from input_layouts to desired_input_layouts (None leaves
    one alone) before the module runs."""

    def __init__(self, *, input_layouts, desired_input_layouts, use_local_output: bool = False):
        self.input_layouts = list(input_layouts) if isinstance(input_layouts, (list, tuple)) else [input_layouts]
        self.desired_input_layouts = (list(desired_input_layouts) if isinstance(desired_input_layouts, (list, tuple))
                                      else [desired_input_layouts])
        self.use_local_output = use_local_output
        _check_lists("PrepareModuleInput", "input_layouts", self.input_layouts, "desired_input_layouts",
                     self.desired_input_layouts)

    def _apply(self, module, device_mesh):
        src, dst, local = self.input_layouts, self.desired_input_layouts, self.use_local_output
        module.register_forward_pre_hook(
            lambda m, args: _convert_all("PrepareModuleInput", "inputs", args, device_mesh, src, dst, local))
        return module


class PrepareModuleOutput(ParallelStyle):
    """Converts each output from output_layouts to desired_output_layouts."""

    def __init__(self, *, output_layouts, desired_output_layouts, use_local_output: bool = True):
        self.output_layouts = list(output_layouts) if isinstance(output_layouts, (list, tuple)) else [output_layouts]
        self.desired_output_layouts = (list(desired_output_layouts) if isinstance(desired_output_layouts, (list, tuple))
                                       else [desired_output_layouts])
        self.use_local_output = use_local_output
        _check_lists("PrepareModuleOutput", "output_layouts", self.output_layouts, "desired_output_layouts",
                     self.desired_output_layouts)

    def _apply(self, module, device_mesh):
        src, dst, local = self.output_layouts, self.desired_output_layouts, self.use_local_output

        def hook(m, args, out):
            single = not isinstance(out, tuple)
            converted = _convert_all("PrepareModuleOutput", "outputs", (out,) if single else out, device_mesh,
                                     src, dst, local)
            return converted[0] if single else converted

        module.register_forward_hook(hook)
        return module
