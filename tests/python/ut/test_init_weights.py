"""init_empty_weights / init_on_device (the original's): where a module's parameters and buffers
are made, what a parameter keeps when moved, ties, nesting, and lazy modules. One process."""

import weakref

import pytest
import torch
from torch import nn

from hyper_parallel import init_empty_weights, init_on_device


class Tagged(nn.Parameter):
    """A parameter subclass whose constructor takes another argument."""

    def __new__(cls, data, tag):
        made = super().__new__(cls, data)
        made.tag = tag
        return made


def test_parameters_move_buffers_only_when_asked():
    with init_empty_weights():
        norm = nn.BatchNorm1d(4)
    assert norm.weight.is_meta and isinstance(norm.weight, nn.Parameter) and not norm.running_mean.is_meta
    with init_empty_weights(include_buffers=True):
        norm = nn.BatchNorm1d(4)
        norm.register_buffer("scratch", torch.ones(2), persistent=False)
    assert norm.running_mean.is_meta and norm.scratch.is_meta and "scratch" not in norm.state_dict()
    assert not nn.Linear(2, 2).weight.is_meta  # restored on exit


def test_a_moved_parameter_keeps_its_class_flag_attributes_and_ties():
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    frozen.note = "kept"
    tagged = Tagged(torch.ones(3), tag="t")
    shared = nn.Parameter(torch.ones(4))
    with init_on_device("meta"):
        a, b = nn.Module(), nn.Module()
        a.frozen, a.tagged, a.weight, b.weight = frozen, tagged, shared, shared
    assert a.frozen.is_meta and not a.frozen.requires_grad and a.frozen.note == "kept"
    assert type(a.tagged) is Tagged and a.tagged.tag == "t" and a.tagged.is_meta
    assert a.weight is b.weight and a.weight.is_meta


def test_the_innermost_context_wins_and_an_exception_restores_torch():
    with init_on_device("meta"):
        with init_on_device("cpu"):
            inner = nn.Linear(2, 2)
        outer = nn.Linear(2, 2)
    assert not inner.weight.is_meta and outer.weight.is_meta
    with pytest.raises(ZeroDivisionError):
        with init_empty_weights(include_buffers=True):
            _ = 1 / 0
    assert not nn.BatchNorm1d(2).running_mean.is_meta and not nn.Linear(2, 2).weight.is_meta


def test_a_lazy_module_materializes_where_its_input_is():
    with init_empty_weights():
        lazy = nn.LazyLinear(3)
    assert lazy(torch.ones(2, 5)).shape == (2, 3) and not lazy.weight.is_meta


def test_a_moved_parameter_s_original_is_freed_inside_the_context():
    """The peak is one parameter, not the model: nothing keeps what a module made."""
    with init_empty_weights():
        holder = nn.Module()
        made = nn.Parameter(torch.ones(1024))
        original = weakref.ref(made)
        holder.weight = made
        del made
        assert original() is None and holder.weight.is_meta
