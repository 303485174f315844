"""A tiny Llama-style language model (RMSNorm, rotary attention, SwiGLU) with a built-in
tensor-parallel plan: the shipped task for mesh layouts (docs/layouts.md).

Same data and loss as ``charlm`` (bytes of the Python standard library). The attention and
feed-forward projections are separate ``nn.Linear`` modules named as torchtitan names them
(``layers.N.attention.wq``, ``layers.N.feed_forward.w1``), so a tensor-parallel plan is a
column split of ``wq/wk/wv`` and ``w1/w3`` and a row split of ``wo`` and ``w2``; the
attention reads its head count from the local shape, so each tensor rank runs
``heads / tensor`` heads. Embedding, norms and output head stay replicated along ``tp`` and
are sharded by FSDP2 along the data-parallel dimensions.

``plan`` (a task argument) is that plan as data: module pattern -> ``colwise`` / ``rowwise``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from elastic_harness.tasks.charlm import ByteWindows, next_byte_loss, stdlib_text

PLAN = {
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
}


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x[..., ::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # -1 heads: this rank's share under tensor parallelism
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(rotary(q, cos, sin), rotary(k, cos, sin), v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, block_size: int, dim: int, layers: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(256, dim)
        self.layers = nn.ModuleList(Layer(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, 256, bias=False)
        half = dim // heads // 2
        angles = torch.outer(torch.arange(block_size).float(), 10000.0 ** (-torch.arange(half).float() / half))
        # recomputed on build, not saved: the same at any layout
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


class TinyLlamaLM:
    """Byte-level language modelling with a Llama-style model; mean cross-entropy per sample."""

    def __init__(self, block_size: int = 32, dim: int = 64, layers: int = 2, heads: int = 4,
                 hidden: int = 128, max_chars: int = 200_000, plan: dict | None = None) -> None:
        if dim % heads or (dim // heads) % 2:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads}) into an even head size")
        self.block_size, self.dim, self.layers, self.heads, self.hidden = block_size, dim, layers, heads, hidden
        self.max_chars = max_chars
        self.plan = dict(PLAN if plan is None else plan)
        bad = {k: v for k, v in self.plan.items() if v not in ("colwise", "rowwise")}
        if bad:
            raise ValueError(f"plan values must be colwise or rowwise, got {bad}")

    def build_model(self) -> nn.Module:
        return TinyLlama(self.block_size, self.dim, self.layers, self.heads, self.hidden)

    def dataset(self) -> ByteWindows:
        return ByteWindows(stdlib_text(self.max_chars), self.block_size)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return next_byte_loss(model, batch)

    def shard_units(self, model: TinyLlama) -> list[nn.Module]:
        """FSDP2 shards each layer on its own (then the root)."""
        return list(model.layers)

    def check_parallelize(self, model: nn.Module, tensor: int) -> None:
        """Before anything starts (``run``'s preflight, on a meta model) and again in each
        worker: the plan names modules the model has, the tensor degree divides what it splits."""
        from elastic_harness.runtime.mesh import check_divides, check_plan

        check_plan(model, self.plan, "task TinyLlamaLM")
        check_divides({"heads": self.heads, "feed_forward hidden": self.hidden}, tensor, "task TinyLlamaLM")

    def parallelize(self, model: nn.Module, mesh: Any) -> nn.Module:
        """The built-in tensor-parallel plan on ``mesh["tp"]`` (inputs and outputs replicated
        along ``tp``: each layer's column-split projections feed its row-split ones)."""
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        self.check_parallelize(model, mesh["tp"].size())
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        return parallelize_module(model, mesh["tp"], {k: styles[v]() for k, v in self.plan.items()})
