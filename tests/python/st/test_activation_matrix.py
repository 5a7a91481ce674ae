"""What users put around tensor-parallel Linears, through the styles, against a single-process
float32 reference (forward, input gradient, every weight gradient), at 2 and 4 ranks:

* between a column and a row layer: exact and tanh GELU, SiLU, SwiGLU, ReLU, tanh, sigmoid, GELU
  upcast to float32;
* on the sequence-parallel side (between a row layer and the next column layer): LayerNorm and
  RMSNorm (SequenceParallel), a residual add, Dropout(p=0) (SequenceParallel);

for the plain styles and MC2 (deferred weight gradients on and off), batch-first [B, S, H] and
sequence-first [S, B, H], float32 and bfloat16. A row layer once handed GELU a transposed
gradient, which torch 1.13's CPU kernel misreads (docs/known-torch-bugs.md)."""

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn
import torch.nn.functional as F

import hyper_parallel
from hyper_parallel import (ColwiseParallel, MC2ColwiseParallel, MC2RowwiseParallel, RowwiseParallel, SequenceParallel,
                            init_device_mesh)
from hyper_parallel.core import comm
from hyper_parallel.core.dtensor.placement_types import Shard
from hyper_parallel.core.tensor_parallel.mc2 import MC2Contract, MC2Options

BATCH, LOCAL_SEQ, K = 3, 2, 256
# ||actual - expected|| / ||expected||. bf16: ReLU's mask flips where one rounding more (MC2 adds
# the bias after the collective, to a rounded product) moves a pre-activation across zero (up to
# 3% measured; under 2% for the smooth activations). A layout or sharding bug is off by far more.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2}
STYLES = ("plain", "mc2_deferred", "mc2_serial")
CONFIGS = list(itertools.product(STYLES, (1, 0), (torch.float32, torch.bfloat16)))


def config_id(config):
    style, seq_dim, dtype = config
    return f"{style}-{'batch_first' if seq_dim == 1 else 'sequence_first'}-{str(dtype).split('.')[-1]}"


def matches(actual, expected, dtype, what):
    assert actual is not None, f"{what}: no gradient"
    assert actual.shape == expected.shape, what
    a, e = actual.double(), expected.double()
    assert torch.isfinite(a).all(), f"{what}: not finite"
    err = ((a - e).norm() / e.norm().clamp_min(1e-30)).item()
    assert err < TOLERANCE[dtype], f"{what}: relative error {err}"


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def tp_styles(style, seq_dim, dtype):
    """(column style, row style) for the config."""
    if style == "plain":
        return ColwiseParallel(input_layouts=Shard(seq_dim)), RowwiseParallel(output_layouts=Shard(seq_dim))
    contract = MC2Contract.relaxed() if dtype == torch.float32 else MC2Contract.strict()
    options = MC2Options(2, defer_weight_grads=style == "mc2_deferred")
    return (MC2ColwiseParallel(input_layouts=Shard(seq_dim), contract=contract, mc2_options=options),
            MC2RowwiseParallel(output_layouts=Shard(seq_dim), contract=contract, mc2_options=options))


def inputs(seq_dim, dtype, seed):
    """The full activation (float32, for the reference) and this rank's sequence shard."""
    ws, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed)
    shape = (BATCH, LOCAL_SEQ * ws, K) if seq_dim == 1 else (LOCAL_SEQ * ws, BATCH, K)
    full = torch.randn(shape).to(dtype)
    local = full.narrow(seq_dim, r * LOCAL_SEQ, LOCAL_SEQ).clone().requires_grad_(True)
    return full.float().requires_grad_(True), local


def seq_shard(t, seq_dim):
    return t.narrow(seq_dim, dist.get_rank() * LOCAL_SEQ, LOCAL_SEQ)


def run_against_reference(model, plan, seq_dim, dtype, seed):
    """Parallelizes ``model`` (a dtype copy goes to the reference first), runs both, compares the
    output and input gradient; returns (parallel model, reference) for the parameter checks."""
    ref = copy.deepcopy(model).float()
    model = model.to(dtype)
    # The reference's weights are the model's, rounded through its dtype.
    with torch.no_grad():
        for p, q in zip(ref.parameters(), model.parameters()):
            p.copy_(q.float())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    hyper_parallel.parallelize_module(model, mesh, plan)
    full, local = inputs(seq_dim, dtype, seed)
    y = model(local)
    upstream = torch.randn(y.shape).to(dtype)
    y.backward(upstream)
    yr = ref(full)
    yr.backward(comm.all_gather(upstream.float().contiguous(), seq_dim, comm.world()))
    matches(y, seq_shard(yr, seq_dim), dtype, "output")
    matches(local.grad, seq_shard(full.grad, seq_dim), dtype, "input grad")
    return model, ref


def expect_linear_grads(layer, ref_layer, column, dtype, what):
    ws, r = dist.get_world_size(), dist.get_rank()
    dim = 0 if column else 1
    matches(layer.weight.grad, torch.chunk(ref_layer.weight.grad, ws, dim)[r], dtype, f"{what} weight grad")
    ref_bias = torch.chunk(ref_layer.bias.grad, ws, 0)[r] if column else ref_layer.bias.grad
    matches(layer.bias.grad, ref_bias, dtype, f"{what} bias grad")


# ---- Between a column and a row layer ---------------------------------------------------------

# ReLU's derivative jumps at 0, so a pre-activation within rounding of 0 flips its mask: a float32
# reference sum that is exactly 0.0 where MC2's chunked sum gives 3.7e-7 hands one element the whole
# gradient on one side and none on the other (2% of the input gradient's norm, at 4 ranks on an
# AVX-512 CPU). On both sides h's gradient is scaled by min(|h| / KINK_RAMP, 1), which is 0 at the
# kink and continuous, so relu's jump there no longer matters, and a rounding difference d moves one
# element's gradient by about d / KINK_RAMP (1e-4 of it for d = 1e-6). The forward value is h
# exactly, and relu's own backward still receives the row layer's gradient as that layer hands it
# over.
KINK_RAMP = 1e-2


def ramp_gradient_near_kink(h):
    scale = (h.detach().abs() / KINK_RAMP).clamp_max(1)
    return h.detach() + (h - h.detach()) * scale


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "silu": F.silu,
    "relu": lambda h: F.relu(ramp_gradient_near_kink(h)),
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "gelu_fp32_upcast": lambda h: F.gelu(h.float()).to(h.dtype),
}


class MLP(nn.Module):
    """down(act(up(x))), or SwiGLU's down(silu(up(x)) * gate(x)); a GPT-style MLP."""

    def __init__(self, hidden, act):
        super().__init__()
        torch.manual_seed(21)
        self.up, self.gate, self.down = nn.Linear(K, hidden), nn.Linear(K, hidden), nn.Linear(hidden, K)
        self.act = act

    def forward(self, x):
        if self.act == "swiglu":
            return self.down(F.silu(self.up(x)) * self.gate(x))
        return self.down(ACTIVATIONS[self.act](self.up(x)))


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@pytest.mark.parametrize("act", list(ACTIVATIONS) + ["swiglu"])
def test_between_column_and_row(config, act):
    style, seq_dim, dtype = config
    column, row = tp_styles(style, seq_dim, dtype)
    plan = {"up": column, "down": row}
    if act == "swiglu":
        plan["gate"] = tp_styles(style, seq_dim, dtype)[0]
    model, ref = run_against_reference(MLP(256 * dist.get_world_size(), act), plan, seq_dim, dtype, 24)
    expect_linear_grads(model.up, ref.up, True, dtype, "up")
    if act == "swiglu":
        expect_linear_grads(model.gate, ref.gate, True, dtype, "gate")
    expect_linear_grads(model.down, ref.down, False, dtype, "down")


# ---- On the sequence-parallel side ------------------------------------------------------------


class Block(nn.Module):
    """row2(gelu(col2(op(row1(silu(col1(x))), x)))): ``op`` acts on each rank's own tokens."""

    def __init__(self, hidden, op):
        super().__init__()
        torch.manual_seed(31)
        self.col1, self.row1 = nn.Linear(K, hidden), nn.Linear(hidden, K)
        self.col2, self.row2 = nn.Linear(K, hidden), nn.Linear(hidden, K)
        self.op = op
        self.norm = {"layer_norm": nn.LayerNorm(K), "rms_norm": RMSNorm(K), "dropout_p0": nn.Dropout(0.0)}.get(op)
        if isinstance(self.norm, (nn.LayerNorm, RMSNorm)):
            with torch.no_grad():
                self.norm.weight.copy_(1 + 0.1 * torch.randn(K))

    def forward(self, x):
        r = self.row1(F.silu(self.col1(x)))
        h = r + x if self.op == "residual_add" else self.norm(r)
        return self.row2(F.gelu(self.col2(h)))


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "residual_add", "dropout_p0"])
def test_sequence_parallel_side(config, op):
    style, seq_dim, dtype = config
    column, row = tp_styles(style, seq_dim, dtype)
    column2, row2 = tp_styles(style, seq_dim, dtype)
    plan = {"col1": column, "row1": row, "col2": column2, "row2": row2}
    if op != "residual_add":
        plan["norm"] = SequenceParallel(sequence_dim=seq_dim)
    model, ref = run_against_reference(Block(256 * dist.get_world_size(), op), plan, seq_dim, dtype, 37)
    for name, column_layer in (("col1", True), ("row1", False), ("col2", True), ("row2", False)):
        expect_linear_grads(getattr(model, name), getattr(ref, name), column_layer, dtype, name)
    if model.norm is not None:
        for name, param in model.norm.named_parameters():
            # Summed over the mesh by SequenceParallel.
            matches(param.grad, dict(ref.norm.named_parameters())[name].grad, dtype, f"norm {name} grad")
