"""A small byte-level transformer language model trained on real text found offline.

The corpus is the Python standard library's own sources (always on disk): the top-level
``*.py`` files of the stdlib, sorted by name, concatenated and cut at ``max_chars``. A
sample is ``block_size + 1`` consecutive bytes; samples do not overlap. The vocabulary is
the 256 byte values, so there is nothing to build or download.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def next_byte_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Per-window mean cross-entropy of predicting each next byte (the byte-level tasks' loss)."""
    x, y = batch[:, :-1], batch[:, 1:]
    logits = model(x)
    ce = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), reduction="none")
    return ce.view(y.shape).mean(dim=1)


def stdlib_text(max_chars: int) -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(root.glob("*.py")):
        out += path.read_bytes()
        if len(out) >= max_chars:
            break
    return bytes(out[:max_chars])


class ByteWindows(torch.utils.data.Dataset):
    def __init__(self, data: bytes, block_size: int) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.block = block_size
        self.count = (len(self.data) - 1) // block_size

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.block
        return self.data[start : start + self.block + 1]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    def __init__(self, block_size: int, dim: int, layers: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, dim)
        self.pos = nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class CharLM:
    """Byte-level language modelling on stdlib sources; loss is mean cross-entropy per sample."""

    def __init__(
        self,
        block_size: int = 64,
        dim: int = 64,
        layers: int = 2,
        heads: int = 4,
        dropout: float = 0.0,
        max_chars: int = 400_000,
    ) -> None:
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.block_size, self.dim, self.layers, self.heads = block_size, dim, layers, heads
        self.dropout, self.max_chars = dropout, max_chars

    def build_model(self) -> nn.Module:
        return TinyGPT(self.block_size, self.dim, self.layers, self.heads, self.dropout)

    def dataset(self) -> ByteWindows:
        return ByteWindows(stdlib_text(self.max_chars), self.block_size)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return next_byte_loss(model, batch)

    def shard_units(self, model: TinyGPT) -> list[nn.Module]:
        """FSDP2 shards each transformer block on its own (then the root)."""
        return list(model.blocks)
