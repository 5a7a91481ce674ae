"""Bugs of the PyTorch this library builds on (Debian's torch 1.13.1), pinned: each test states
the correct behaviour and is expected to fail on the torch that has the bug (strict: when a torch
fixes it, the test passes unexpectedly and the suite says so). docs/known-torch-bugs.md says how
the library stays clear of each."""

import pytest
import torch
import torch.nn.functional as F

TORCH_1 = torch.__version__.split(".")[0] == "1"


@pytest.mark.xfail(TORCH_1, strict=True,
                   reason="torch 1.13's CPU GELU backward misreads a non-contiguous incoming gradient")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_backward_reads_a_transposed_gradient(dtype):
    torch.manual_seed(0)
    u = torch.randn(3, 12, 512, dtype=dtype)
    grad = torch.randn(12, 3, 512, dtype=dtype).transpose(0, 1)  # strides (512, 1536, 1)
    assert not grad.is_contiguous()
    transposed, contiguous = u.clone().requires_grad_(True), u.clone().requires_grad_(True)
    F.gelu(transposed).backward(grad)
    F.gelu(contiguous).backward(grad.contiguous())
    assert torch.equal(transposed.grad, contiguous.grad)


@pytest.mark.parametrize("fn", [lambda h: F.gelu(h, approximate="tanh"), F.silu, F.relu, torch.tanh, torch.sigmoid],
                         ids=["gelu_tanh", "silu", "relu", "tanh", "sigmoid"])
def test_other_activation_backwards_read_a_transposed_gradient(fn):
    torch.manual_seed(0)
    u = torch.randn(3, 12, 512)
    grad = torch.randn(12, 3, 512).transpose(0, 1)
    transposed, contiguous = u.clone().requires_grad_(True), u.clone().requires_grad_(True)
    fn(transposed).backward(grad)
    fn(contiguous).backward(grad.contiguous())
    assert torch.equal(transposed.grad, contiguous.grad)
