"""A byte-level language model trained on a *stream*: tokenized document shards, packed.

The corpus is built on first use from the Python standard library's own sources (always on
disk, nothing downloaded): each top-level function or class of the stdlib's ``*.py`` files is
one document, tokenized as its UTF-8 bytes plus an end-of-document id (0), so documents have
very different lengths. They are dealt into ``shards`` files of ``{"ids": [...]}`` lines, in
one of these layouts (``format``):

- ``jsonl``: one JSON document per line (read by ``data.jsonl_stream``);
- ``hf``: the same jsonl files through Hugging Face ``load_dataset("json", streaming=True)``;
- ``tar``: webdataset-layout tar files (``000042.json`` members; ``data.tar_stream``);
- ``parquet``: an ``ids`` list column (``data.parquet_stream``).

Whatever the layout, the same documents are packed into sequences of ``block_size + 1``
tokens in the same order (``data.order``), so every layout trains the same model bit for bit.
``data_dir`` may be a local directory or an ``s3://`` URL (the corpus is uploaded there when
missing); by default it is ``RUN_DIR/corpus``.
"""

from __future__ import annotations

import ast
import io
import json
import os
import sysconfig
import tarfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from elastic_harness.data import (
    Packing,
    Stream,
    hf_stream,
    jsonl_stream,
    parquet_stream,
    tar_stream,
)
from elastic_harness.data.read import DataError
from elastic_harness.tasks.charlm import TinyGPT

EOD = 0
SUFFIX = {"jsonl": "jsonl", "hf": "jsonl", "tar": "tar", "parquet": "parquet"}


def stdlib_documents(max_docs: int) -> list[list[int]]:
    """Top-level functions and classes of the stdlib's sources, as byte tokens + EOD."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[list[int]] = []
    for path in sorted(root.glob("*.py")):
        text = path.read_text(errors="replace")
        try:
            nodes = ast.parse(text).body
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.end_lineno:
                body = "\n".join(lines[node.lineno - 1 : node.end_lineno])[:4000]
                docs.append([b or 1 for b in body.encode()][:4000] + [EOD])
                if len(docs) == max_docs:
                    return docs
    return docs


def shard_docs(docs: list[list[int]], shards: int) -> list[list[list[int]]]:
    """Deal documents into shards of uneven sizes (contiguous runs, every third shard short)."""
    weights = [1 if i % 3 == 2 else 3 for i in range(shards)]
    total, out, at = sum(weights), [], 0
    for i, w in enumerate(weights):
        end = len(docs) if i == shards - 1 else at + len(docs) * w // total
        out.append(docs[at:end])
        at = end
    return out


def shard_bytes(docs: list[list[int]], fmt: str) -> bytes:
    if fmt in ("jsonl", "hf"):
        return "".join(json.dumps({"ids": d}) + "\n" for d in docs).encode()
    if fmt == "tar":
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for k, d in enumerate(docs):
                data = json.dumps({"ids": d}).encode()
                info = tarfile.TarInfo(f"{k:06d}.json")
                info.size, info.mtime = len(data), 0
                tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        buf = io.BytesIO()
        pq.write_table(pa.table({"ids": docs}), buf, row_group_size=16)
        return buf.getvalue()
    raise ValueError(f"format {fmt!r}: use one of {sorted(SUFFIX)}")


def build_corpus(data_dir: str, shards: int, max_docs: int, fmt: str) -> list[str]:
    """Write the corpus's shards (each atomically: ranks may build it at once); their URLs."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(data_dir)
    names = [f"{data_dir.rstrip('/')}/shard-{i:03d}.{SUFFIX[fmt]}" for i in range(shards)]
    if all(fs.exists(fsspec.core.url_to_fs(n)[1]) for n in names):
        return names  # nothing is written: a read-only data_dir that holds the corpus is fine
    try:
        fs.makedirs(root, exist_ok=True)
        for name, docs in zip(names, shard_docs(stdlib_documents(max_docs), shards), strict=True):
            path = fsspec.core.url_to_fs(name)[1]
            tmp = f"{path}.tmp{os.getpid()}"
            fs.pipe_file(tmp, shard_bytes(docs, fmt))
            fs.mv(tmp, path)
    except OSError as e:  # read-only, no permission, full: the same on every restart
        raise not_writable(data_dir, names, e) from None
    return names


def not_writable(data_dir: str, names: list[str], e: OSError) -> DataError:
    """The one line for a corpus that cannot be built where the job says (not retried: a
    restart would fail the same way)."""
    first, last = names[0].rsplit("/", 1)[-1], names[-1].rsplit("/", 1)[-1]
    return DataError(
        f"data_dir '{data_dir}' cannot be written ({e.strerror or type(e).__name__}): the corpus is "
        f"built there on first use ({len(names)} shards, {first} .. {last}) and only read afterwards",
        "make it writable for the first run, or point data_dir at a writable directory, or at one "
        "that already holds those shards; the checkpoints are untouched")


def ids_of(sample: Any) -> Any:
    """A document's token ids, whichever layout it was read from."""
    if "ids" in sample:
        return sample["ids"]
    return json.loads(sample["json"])["ids"]  # a webdataset tar sample: {"__key__", "json"}


class StreamLM:
    """Byte-level LM over a packed document stream; loss is mean cross-entropy per sequence."""

    def __init__(self, data_dir: str | None = None, format: str = "jsonl", shards: int = 8,
                 max_docs: int = 600, block_size: int = 32, dim: int = 32, layers: int = 1,
                 heads: int = 2, lanes: int | None = None, window: int = 1) -> None:
        if format not in SUFFIX:
            raise ValueError(f"format {format!r}: use one of {sorted(SUFFIX)}")
        self.data_dir, self.format, self.shards, self.max_docs = data_dir, format, shards, max_docs
        self.block_size, self.dim, self.layers, self.heads = block_size, dim, layers, heads
        self.lanes, self.window = lanes, window

    def build_model(self) -> nn.Module:
        return TinyGPT(self.block_size, self.dim, self.layers, self.heads, 0.0)

    def corpus(self) -> list[str]:
        data_dir = self.data_dir
        if data_dir is None:
            from elastic_harness.runtime.session import active

            run = active()
            data_dir = str((run.run_dir if run is not None else Path("runs")) / "corpus")
        return build_corpus(data_dir, self.shards, self.max_docs, self.format)

    def dataset(self) -> Stream:
        names = self.corpus()
        kw = dict(pack=Packing(self.block_size + 1, ids_of), lanes=self.lanes, window=self.window)
        if self.format == "jsonl":
            return jsonl_stream(names, **kw)
        if self.format == "tar":
            return tar_stream(names, **kw)
        if self.format == "parquet":
            return parquet_stream(names, columns=["ids"], **kw)
        from datasets import load_dataset

        ds = load_dataset("json", data_files=names, split="train", streaming=True)
        return hf_stream(ds, **kw)

    def collate(self, items: list) -> torch.Tensor:
        return torch.stack([torch.as_tensor(x) for x in items])

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        logits = model(x)
        ce = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), reduction="none")
        return ce.view(y.shape).mean(dim=1)
