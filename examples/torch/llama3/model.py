"""Llama 3 for PyTorch (RMSNorm, rotary embedding, grouped-query causal attention, SwiGLU), the
Python twin of model.h. A plain model: it knows nothing of parallelism; parallelize.py holds the
plan. Batch, sequence and head counts are read from tensor shapes, so the same code runs on
sharded weights and sequence-sharded activations."""

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class ModelArgs:
    """The C++ ModelArgs (model.h), preset for preset, so the two trainers' checkpoints hold the same
    keys and shapes."""

    dim: int = 256
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 1024
    multiple_of: int = 256
    ffn_dim_multiplier: float = 1.5
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 64

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size, as in Llama: 2/3 of 4*dim, times the multiplier, rounded up."""
        hidden = int(self.ffn_dim_multiplier * int(2 * 4 * self.dim / 3))
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @staticmethod
    def debug() -> "ModelArgs":
        return ModelArgs()

    @staticmethod
    def tiny() -> "ModelArgs":
        return ModelArgs(dim=16, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=8, multiple_of=16,
                         ffn_dim_multiplier=1.0, max_seq_len=8)

    @staticmethod
    def bench() -> "ModelArgs":
        return ModelArgs(dim=1024, n_layers=2, n_heads=8, n_kv_heads=8, vocab_size=4096, ffn_dim_multiplier=1.0,
                         max_seq_len=256)

    @staticmethod
    def small() -> "ModelArgs":
        """Every Linear within the MC2 contract at TP 2 and 4."""
        return dataclasses.replace(ModelArgs.bench(), n_layers=1, vocab_size=2048, max_seq_len=64)

    @staticmethod
    def from_preset(name: str) -> "ModelArgs":
        presets = {"debug": ModelArgs.debug, "tiny": ModelArgs.tiny, "small": ModelArgs.small,
                   "bench": ModelArgs.bench}
        if name not in presets:
            raise ValueError(f"ModelArgs.from_preset: expected one of {sorted(presets)}, got {name!r}")
        return presets[name]()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def apply_rope(x, cos, sin):
    s = x.shape[1]
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, sn = cos[:s].unsqueeze(1), sin[:s].unsqueeze(1)
    return torch.stack((x0 * c - x1 * sn, x0 * sn + x1 * c), -1).flatten(-2).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        hd = args.head_dim
        self.head_dim = hd
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        inv_freq = args.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), inv_freq).float()
        # Persistent, as the C++ model's: a checkpoint holds the same keys in both languages.
        self.register_buffer("rope_cos", angles.cos())
        self.register_buffer("rope_sin", angles.sin())

    def forward(self, x):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        b, s, hd = q.shape[0], q.shape[1], self.head_dim
        q, k, v = q.view(b, s, -1, hd), k.view(b, s, -1, hd), v.view(b, s, -1, hd)
        q, k = apply_rope(q, self.rope_cos, self.rope_sin), apply_rope(k, self.rope_cos, self.rope_sin)
        repeats = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(repeats, 2), v.repeat_interleave(repeats, 2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(hd)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1).to(x.dtype)
        return self.wo((probs @ v).transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def synthetic_batch(seed: int, step: int, batch_size: int, seq_len: int, vocab_size: int):
    """Sequences t_{i+1} = (5 t_i + 3) mod vocab from a start token drawn from (seed, step): the
    model can learn them, so the loss falls. [B, S + 1]: inputs [:, :S], targets [:, 1:]."""
    gen = torch.Generator().manual_seed(seed * 1000003 + step)
    cols = [torch.randint(vocab_size, (batch_size,), generator=gen)]
    for _ in range(seq_len):
        cols.append((cols[-1] * 5 + 3) % vocab_size)
    return torch.stack(cols, 1)


def train_steps(model: Transformer, args: ModelArgs, steps: int, batch_size: int = 2, seed: int = 42,
                lr: float = 1e-3, log=None):
    """AdamW steps on synthetic data with full logits (no loss parallel); returns the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    losses = []
    for step in range(1, steps + 1):
        batch = synthetic_batch(seed, step, batch_size, args.max_seq_len, args.vocab_size)
        inputs, targets = batch[:, :args.max_seq_len], batch[:, 1:]
        optimizer.zero_grad()
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if log:
            log(step, losses[-1])
    return losses
