"""Parallel styles for torch.nn modules, shaped as torch.distributed.tensor.parallel's: keyword
options, layouts kept as tuples, a public ``apply(module, device_mesh)``.

A style installs hooks and nothing else. Each holds the C++ core's style of the same name, which
owns every rule: the kinds of module it takes, the contract's limits, the parameter table (which
parameter gets which placement, which gradient is summed) and the computation each hook runs.
Parameters are sharded in place (the Parameter objects stay, so an optimizer made before or after
sees them). Between modules tensors are local shards; ``use_local_output=False`` returns the local
tensor tagged with its layout, so the next style reads its placements (the C++ core's tag).
"""

import types
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.nn.utils import parametrize

from hyper_parallel import _C
from hyper_parallel.core.dtensor.placement_types import Placement, Replicate, Shard
from hyper_parallel.core.tensor_parallel.forward_wrap import wrap_forward
from hyper_parallel.core.tensor_parallel.summed_reads import sum_gradients_of_reads


def _module_kind(module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    return "embedding" if isinstance(module, nn.Embedding) else "other"


def _layouts(value, default) -> Tuple:
    """A layout argument as a tuple: None -> (default,), a placement -> (it,), a sequence -> tuple."""
    if value is None:
        return (default,)
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _core_mesh(device_mesh):
    """The C++ core's mesh for ``device_mesh``: ours as it is; any other mesh that offers
    ``get_group()`` and ``size()`` (torch's, the original's) as the 1-d mesh over its group."""
    if isinstance(device_mesh, _C.DeviceMesh):
        return device_mesh
    if callable(getattr(device_mesh, "get_group", None)) and callable(getattr(device_mesh, "size", None)):
        return _C.mesh_of_group(device_mesh.get_group(), device_mesh.size())
    raise TypeError(f"expected a DeviceMesh (or a mesh with get_group() and size()), got {type(device_mesh).__name__}")


def _shard_module(core, module: nn.Module, device_mesh, src_data_rank, *, recurse: bool = False):
    """The apply preamble: the core's, in one call (its checks, then the module's parameters laid
    out by its table; with ``recurse``, its submodules' too). The kind is checked first here too,
    before a foreign mesh is converted. Returns the kind, the core's mesh (_core_mesh) and the
    names of the parameters whose gradient is Partial: the style's apply ends with
    sum_gradients_of_reads of them."""
    kind, module_type = _module_kind(module), type(module).__name__
    core.check_kind(kind, module_type)
    for path, mod in module.named_modules() if recurse else [("", module)]:
        if parametrize.is_parametrized(mod):
            raise NotImplementedError(
                f"{core.name()}: expected a module without parametrizations, got {type(mod).__name__}"
                f"{f' ({path!r})' if path else ''} with parametrized {', '.join(mod.parametrizations.keys())} "
                "(its parameters are its parametrizations' own, which the style does not lay out)")
    device_mesh = _core_mesh(device_mesh)
    summed = _C.lay_out_parameters(core, kind, module_type, list(module.named_parameters(recurse=recurse)),
                                   getattr(module, "_hp_sharding_style", None), device_mesh, src_data_rank)
    module._hp_sharding_style = core.name()
    return kind, device_mesh, summed


def _replace_first_input(style: str, convert):
    def hook(module, args):
        if not args:  # module(input=x): the hook cannot convert what it does not see
            raise ValueError(f"{style}: expected the input as a positional argument (module(x)), got none; "
                             "torch 1.13's forward pre-hooks do not see keyword arguments")
        return (convert(args[0]),) + tuple(args[1:])

    return hook


def _check_own_forward(style: str, module: nn.Module, base) -> None:
    """A style that replaces the module's forward takes only modules whose forward is ``base``'s:
    a subclass's own forward would be dropped silently."""
    if type(module).forward is not base.forward:
        raise NotImplementedError(f"{style}: expected a module whose forward is {base.__module__}.{base.__name__}'s, "
                                  f"got {type(module).__name__} with a forward of its own (the style replaces it)")


def _check_embedding_options(style: str, module: nn.Embedding) -> None:
    """The vocabulary-sharded lookup keeps padding_idx; the options that act on whole rows across
    the table (or make sparse gradients) it cannot keep."""
    for option, unset in (("max_norm", None), ("scale_grad_by_freq", False), ("sparse", False)):
        if getattr(module, option) != unset:
            raise NotImplementedError(f"{style}: expected an nn.Embedding with {option}={unset}, "
                                      f"got {getattr(module, option)}")


class ParallelStyle:
    """Applied to one module by parallelize_module (or directly: ``style.apply(module, mesh)``).
    ``src_data_rank``: the TP rank whose parameter values are sharded (None: every rank shards its
    own copy, with no communication)."""

    src_data_rank: Optional[int] = 0
    _lays_out_submodules: bool = False  # the style's parameter table covers the submodules' parameters too

    def apply(self, module: nn.Module, device_mesh) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} does not implement apply")

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        """torch.distributed.tensor.parallel's spelling of apply."""
        return self.apply(module, device_mesh)


class ColwiseParallel(ParallelStyle):
    """Linear weight and bias Shard(0), Embedding weight Shard(1); the input is made Replicate
    (a Shard input is all-gathered, its Partial gradient reduce-scattered); the output is
    Shard(-1) unless output_layouts says otherwise."""

    def __init__(self, *, input_layouts: Optional[Placement] = None, output_layouts: Optional[Placement] = None,
                 use_local_output: bool = True):
        self.input_layouts = _layouts(input_layouts, Replicate())
        self.output_layouts = _layouts(output_layouts, Shard(-1))
        self.desired_input_layouts = (Replicate(),)
        self.use_local_output = use_local_output
        self._core()  # the core checks the options now

    def _core(self):
        return _C.ColwiseParallel(self.input_layouts[0], self.output_layouts[0], self.use_local_output)

    def apply(self, module, device_mesh):
        core = self._core()
        kind, mesh, summed = _shard_module(core, module, device_mesh, self.src_data_rank)
        self._install_hooks(core, module, kind, mesh)
        sum_gradients_of_reads(module, summed, mesh)
        return module

    def _install_hooks(self, core, module, kind, mesh):
        module.register_forward_pre_hook(
            _replace_first_input(type(self).__name__, lambda x: core.prepare_input(x, kind, mesh)))
        # The whole output width: an uneven split of it is not the local width times the ranks.
        features = module.out_features if kind == "linear" else module.embedding_dim
        module.register_forward_hook(lambda m, args, y: core.prepare_output(y, mesh, features))


class RowwiseParallel(ParallelStyle):
    """Linear weight Shard(1), bias Replicate and added once after the reduction; Embedding
    weight Shard(0) over the vocabulary with a Replicate input. The local result is Partial:
    all-reduced to Replicate or reduce-scattered to a Shard output. ``reduce_dtype``: the
    reduction's accumulate dtype; 16-bit reductions always accumulate in float32, so only None
    and torch.float32 are accepted."""

    def __init__(self, *, input_layouts: Optional[Placement] = None, output_layouts: Optional[Placement] = None,
                 use_local_output: bool = True, reduce_dtype=None):
        if reduce_dtype not in (None, torch.float32):
            raise NotImplementedError(f"{type(self).__name__}: reduce_dtype {reduce_dtype} is not supported; "
                                      "16-bit reductions accumulate in torch.float32 (None or torch.float32)")
        self.input_layouts = _layouts(input_layouts, Shard(-1))
        self.output_layouts = _layouts(output_layouts, Replicate())
        self.desired_input_layouts = (Shard(-1),)
        self.use_local_output = use_local_output
        self.reduce_dtype = reduce_dtype
        self._core()

    def _core(self):
        return _C.RowwiseParallel(self.input_layouts[0], self.output_layouts[0], self.use_local_output)

    def apply(self, module, device_mesh):
        core = self._core()
        kind = _module_kind(module)
        if kind != "other" and type(self)._install_hooks is RowwiseParallel._install_hooks:
            _check_own_forward(type(self).__name__, module, nn.Linear if kind == "linear" else nn.Embedding)
        if kind == "embedding":
            _check_embedding_options(type(self).__name__, module)
        kind, mesh, summed = _shard_module(core, module, device_mesh, self.src_data_rank)
        self._install_hooks(core, module, kind, mesh)
        sum_gradients_of_reads(module, summed, mesh)
        return module

    def _install_hooks(self, core, module, kind, mesh):
        if kind == "embedding":
            self.desired_input_layouts = (Replicate(),)
            vocab, padding_idx = module.num_embeddings, module.padding_idx
            module.forward = types.MethodType(
                lambda m, ids: core.forward_embedding(ids, m.weight, vocab, mesh, padding_idx), module)
            return
        module.register_forward_pre_hook(
            _replace_first_input(type(self).__name__, lambda x: core.prepare_input(x, mesh)))
        module.forward = types.MethodType(lambda m, x: core.forward_linear(x, m.weight, m.bias, mesh), module)


class SequenceParallel(ParallelStyle):
    """For modules that act on each token alone (norms, dropout): the parameters of the module
    and of its submodules stay replicated, the input is Shard(sequence_dim), no communication in
    forward; the gradient of the module's forward on the parameters (Partial) is summed over the
    mesh in backward, a loss term on the parameters themselves is not."""

    _lays_out_submodules = True

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        self.sequence_sharding = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    def _core(self):
        return _C.SequenceParallel(self.sequence_sharding[0].dim, self.use_local_output)

    def apply(self, module, device_mesh):
        core = self._core()
        _, mesh, summed = _shard_module(core, module, device_mesh, self.src_data_rank,
                                        recurse=self._lays_out_submodules)
        module.register_forward_pre_hook(lambda m, args: core.prepare_inputs(args, mesh))
        module.register_forward_hook(lambda m, args, y: core.prepare_output(y, mesh))
        sum_gradients_of_reads(module, summed, mesh)
        return module


Layouts = Union[Optional[Placement], Sequence[Optional[Placement]]]


def _check_tensors_at_layouts(style: str, what: str, values: Tuple, layouts: Tuple) -> None:
    """Each value a layout converts must be a tensor: anything else would pass through as it is."""
    for i, (value, layout) in enumerate(zip(values, layouts)):
        if layout is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"{style}: expected a tensor as {what} {i} (layout {layout}), got {type(value).__name__}")


class PrepareModuleInput(ParallelStyle):
    """Converts each positional input from input_layouts to desired_input_layouts (None leaves
    one alone; no input_layouts: all), and each keyword input named in input_kwarg_layouts to its
    desired_input_kwarg_layouts entry (none: it keeps its layout, tagged with it), before the
    module runs."""

    def __init__(self, *, input_layouts: Layouts = None, desired_input_layouts: Layouts = None,
                 input_kwarg_layouts: Optional[Dict[str, Placement]] = None,
                 desired_input_kwarg_layouts: Optional[Dict[str, Placement]] = None, use_local_output: bool = False):
        if input_layouts is not None and desired_input_layouts is None:
            raise ValueError(f"PrepareModuleInput: expected desired_input_layouts with input_layouts "
                             f"{input_layouts}, got None")
        self.input_layouts = None if input_layouts is None else _layouts(input_layouts, None)
        self.desired_input_layouts = None if input_layouts is None else _layouts(desired_input_layouts, None)
        self.input_kwarg_layouts = dict(_keyword_layouts("input_kwarg_layouts", input_kwarg_layouts))
        self.desired_input_kwarg_layouts = dict(_keyword_layouts("desired_input_kwarg_layouts",
                                                                 desired_input_kwarg_layouts))
        unknown = sorted(set(self.desired_input_kwarg_layouts) - set(self.input_kwarg_layouts))
        if unknown:
            raise ValueError(f"PrepareModuleInput: expected desired_input_kwarg_layouts for keyword inputs that "
                             f"input_kwarg_layouts names ({sorted(self.input_kwarg_layouts)}), got {unknown[0]!r}")
        self.use_local_output = use_local_output
        self._core()
        self._keyword_core()

    def _core(self):
        if self.input_layouts is None:
            return None
        return _C.PrepareModuleInput(list(self.input_layouts), list(self.desired_input_layouts), self.use_local_output)

    def _keyword_core(self):
        """The C++ core's conversion of the keyword inputs input_kwarg_layouts names, in its order."""
        if not self.input_kwarg_layouts:
            return None
        keys = list(self.input_kwarg_layouts)
        return keys, _C.PrepareModuleInput([self.input_kwarg_layouts[k] for k in keys],
                                           [self.desired_input_kwarg_layouts.get(k, self.input_kwarg_layouts[k])
                                            for k in keys], self.use_local_output)

    def apply(self, module, device_mesh):
        core, keyword, mesh = self._core(), self._keyword_core(), _core_mesh(device_mesh)
        _C.check_tp_mesh("PrepareModuleInput", mesh)
        if core is not None:
            def hook(m, args):
                _check_tensors_at_layouts("PrepareModuleInput", "input", args, self.input_layouts)
                return core.prepare_inputs(args, mesh)

            module.register_forward_pre_hook(hook)
        if keyword is not None:
            keys, keyword_core = keyword

            def convert_keywords(mod, forward, *args, **kwargs):
                for k in keys:
                    if kwargs.get(k) is not None and not isinstance(kwargs[k], torch.Tensor):
                        raise TypeError(f"PrepareModuleInput: expected a tensor as keyword input {k!r} (layout "
                                        f"{self.input_kwarg_layouts[k]}), got {type(kwargs[k]).__name__}")
                values = keyword_core.prepare_inputs([kwargs.get(k) for k in keys], mesh)
                return forward(*args, **{**kwargs, **{k: v for k, v in zip(keys, values) if k in kwargs}})

            wrap_forward(module, convert_keywords)
        return module


def _keyword_layouts(what: str, layouts):
    if layouts is None:
        return {}
    if not isinstance(layouts, dict) or not all(isinstance(k, str) and isinstance(v, Placement)
                                                for k, v in layouts.items()):
        raise TypeError(f"PrepareModuleInput: expected {what} as a dict of keyword name -> placement, got {layouts!r}")
    return layouts


class PrepareModuleOutput(ParallelStyle):
    """Converts each output from output_layouts to desired_output_layouts."""

    def __init__(self, *, output_layouts: Layouts, desired_output_layouts: Layouts, use_local_output: bool = True):
        self.output_layouts = _layouts(output_layouts, None)
        self.desired_output_layouts = _layouts(desired_output_layouts, None)
        self.use_local_output = use_local_output
        self._core()

    def _core(self):
        return _C.PrepareModuleOutput(list(self.output_layouts), list(self.desired_output_layouts),
                                      self.use_local_output)

    def apply(self, module, device_mesh):
        core, mesh = self._core(), _core_mesh(device_mesh)
        _C.check_tp_mesh(core.name(), mesh)

        def hook(m, args, out):
            single = not isinstance(out, tuple)
            outs = (out,) if single else out
            _check_tensors_at_layouts("PrepareModuleOutput", "output", outs, self.output_layouts)
            converted = core.prepare_outputs(outs, mesh)
            return converted[0] if single else converted

        module.register_forward_hook(hook)
        return module


class PrepareModuleInputOutput(ParallelStyle):
    """PrepareModuleInput and PrepareModuleOutput on one module, with torch's signature: the
    inputs are converted before it runs (``use_local_input``: the converted inputs as this rank's
    local tensors), its outputs after."""

    def __init__(self, *, input_layouts: Layouts = None, desired_input_layouts: Layouts = None,
                 input_kwarg_layouts: Optional[Dict[str, Placement]] = None,
                 desired_input_kwarg_layouts: Optional[Dict[str, Placement]] = None, use_local_input: bool = False,
                 output_layouts: Layouts, desired_output_layouts: Layouts, use_local_output: bool = True):
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_module_output = PrepareModuleOutput(output_layouts=output_layouts,
                                                         desired_output_layouts=desired_output_layouts,
                                                         use_local_output=use_local_output)

    def apply(self, module, device_mesh):
        self.prepare_module_input.apply(module, device_mesh)
        return self.prepare_module_output.apply(module, device_mesh)
