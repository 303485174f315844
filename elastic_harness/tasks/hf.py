"""A Hugging Face ``transformers`` causal language model, built from a config (no download).

A model no one here wrote: GPT-2 by default (tied input and output embeddings, a
non-persistent attention buffer), any ``AutoConfig`` model type otherwise, trained on
byte windows of the Python standard library's own sources (``tasks.charlm``). Needs the
``hf`` extra: ``pip install -e '.[hf]'``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from elastic_harness.errors import TaskError
from elastic_harness.tasks.charlm import ByteWindows, stdlib_text


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise TaskError("this task needs Hugging Face transformers, which is not installed",
                        "pip install -e '.[hf]'") from None
    return transformers


class HFCausalLM:
    """Byte-level language modelling with a ``transformers`` model built from ``config``."""

    def __init__(self, model_type: str = "gpt2", block_size: int = 32, max_chars: int = 200_000,
                 eval_chars: int = 20_000, config: dict | None = None) -> None:
        self.model_type, self.block_size = model_type, block_size
        self.max_chars, self.eval_chars = max_chars, eval_chars
        # Dropout off by default: masks are drawn per rank, so with dropout a run resized to
        # another world size follows another (equally valid) trajectory, not the same one.
        self.config = {"vocab_size": 256, "n_positions": block_size, "n_embd": 32, "n_layer": 2,
                       "n_head": 2, "tie_word_embeddings": True, "resid_pdrop": 0.0,
                       "embd_pdrop": 0.0, "attn_pdrop": 0.0, **(config or {})}
        if model_type != "gpt2":
            self.config = {"vocab_size": 256, **(config or {})}

    def build_model(self) -> nn.Module:
        tf = _transformers()
        cfg = tf.AutoConfig.for_model(self.model_type, **self.config)
        return tf.AutoModelForCausalLM.from_config(cfg)

    def dataset(self) -> ByteWindows:
        return ByteWindows(stdlib_text(self.max_chars), self.block_size)

    def eval_dataset(self) -> ByteWindows:
        text = stdlib_text(self.max_chars + self.eval_chars)[self.max_chars:]
        return ByteWindows(text, self.block_size)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy per sample."""
        x, y = batch[:, :-1], batch[:, 1:]
        logits = model(input_ids=x).logits
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), reduction="none")
        return ce.view(y.shape).mean(dim=1)

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        """FSDP2 shards each decoder layer on its own; the tied embeddings stay in the root."""
        base = getattr(model, model.base_model_prefix)
        layers = getattr(base, "h", None) or getattr(base, "layers", None)
        return list(layers) if layers is not None else []
