"""``train.record_samples``' content hash (``runtime.audit.content_hash``) takes every item a
DataLoader can collate, and more, without raising: the audit is how a user proves
exactly-once use, so it must not be what stops a job (issue 33: a 0-dim label crash-looped
at step 0). Equal content hashes alike in every process and whatever the memory layout;
another dtype, shape, value or container hashes otherwise."""

from __future__ import annotations

import collections
import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from elastic_harness.runtime.audit import content_hash
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(60)

Pair = collections.namedtuple("Pair", "image label")


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    name: str


def items() -> dict[str, object]:
    """One of each kind, built deterministically (also in a child process)."""
    g = torch.Generator().manual_seed(0)
    image = torch.randn(3, 4, 4, generator=g)
    return {
        "0-dim int64": torch.tensor(7),
        "0-dim float": torch.tensor(0.5),
        "tensordataset item": (image, torch.tensor(3)),
        "non-contiguous": image.transpose(1, 2),
        "expanded (stride 0)": torch.tensor(2.0).expand(5),
        "bool": torch.tensor([True, False, True]),
        "0-dim bool": torch.tensor(True),
        "complex64": torch.tensor([1 + 2j, -3j]),
        "conjugate view": torch.tensor([1 + 2j, -3j]).conj(),
        "bfloat16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "float16 0-dim": torch.tensor(1.5, dtype=torch.float16),
        "empty": torch.empty(0, 3),
        "sparse": torch.eye(3).to_sparse(),
        "requires grad": torch.ones(2, requires_grad=True),
        "numpy array": np.arange(6, dtype=np.float32).reshape(2, 3),
        "numpy non-contiguous": np.arange(6, dtype=np.int16).reshape(2, 3).T,
        "numpy 0-d": np.array(3.5),
        "numpy scalar": np.float32(3.5),
        "numpy int scalar": np.int64(4),
        "numpy bool scalar": np.bool_(True),
        "numpy strings": np.array(["ab", "c"]),
        "numpy object": np.array([{"a": 1}, None], dtype=object),
        "numpy structured": np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]),
        "string": "héllo \ud800",  # a lone surrogate, as os.fsdecode gives for undecodable names
        "bytes": b"\x00\xff",
        "bytearray": bytearray(b"ab"),
        "None": None,
        "int": 12,
        "big int": 2**80,
        "float": 0.1,
        "nan": float("nan"),
        "bool scalar": True,
        "complex": 1 + 2j,
        "nested dict": {"image": image, "meta": {"id": 5, "tags": ["a", "b"], "ok": None}},
        "dict with int and str keys": {1: "one", "1": "str one"},
        "list": [torch.tensor(1), 2, "3"],
        "namedtuple": Pair(image, torch.tensor(1)),
        "set": {"b", "a", "c"},
        "dataclass": Sample(torch.tensor([1, 2]), "s"),
        "object": object(),
    }


def test_every_kind_of_item_hashes():
    hashes = {name: content_hash(x) for name, x in items().items()}
    assert all(len(h) == 16 for h in hashes.values())
    values = [h for name, h in hashes.items() if name != "object"]
    # distinct items, distinct hashes (the conjugate view differs in value from its base)
    assert len(set(values)) == len(values), sorted(hashes.items(), key=lambda kv: kv[1])


def test_the_same_content_hashes_alike_whatever_its_layout():
    t = torch.arange(12.0).reshape(3, 4)
    assert content_hash(t.t()) == content_hash(t.t().contiguous())
    assert content_hash(torch.tensor(2.0).expand(5)) == content_hash(torch.full((5,), 2.0))
    z = torch.tensor([1 + 2j, -3j])
    assert content_hash(z.conj()) == content_hash(z.conj().resolve_conj())
    assert content_hash(-torch.tensor([1 + 2j]).conj().imag) == content_hash(torch.tensor([2.0]))
    assert content_hash(torch.eye(3).to_sparse()) == content_hash(torch.eye(3))
    a = np.arange(6).reshape(2, 3)
    assert content_hash(a.T) == content_hash(np.ascontiguousarray(a.T))
    assert content_hash({"a": 1, "b": 2}) == content_hash({"b": 2, "a": 1})
    assert content_hash({"x", "y"}) == content_hash({"y", "x"})


def test_dtype_shape_value_and_container_tell_items_apart():
    distinct = [
        torch.tensor(1), torch.tensor([1]), torch.tensor(1, dtype=torch.int32), torch.tensor(1.0),
        torch.tensor(True), torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(1.0, dtype=torch.float16),
        torch.zeros(2, 3), torch.zeros(3, 2), torch.zeros(6),
        np.array(1), np.array([1]), np.int32(1), np.float64(1.5), np.float32(1.5),
        1, 1.0, True, "1", b"1", None, [1], (1,), Pair(1, 2), (1, 2), [1, 2],
        {"a": 1}, {"a": "1"}, {1: 1}, {"1": 1},
        [b"a", b"b"], [b"a,b"], ["a", "b"], ["ab"],  # no two sequences share their bytes
    ]
    hashes = [content_hash(x) for x in distinct]
    assert len(set(hashes)) == len(hashes)


def test_a_container_that_holds_itself_hashes():
    loop: list = [1]
    loop.append(loop)
    assert len(content_hash(loop)) == 16


def test_hashes_are_the_same_in_another_process_with_another_hash_seed():
    code = ("import json; from tests.runtime.test_audit_hash import items; "
            "from elastic_harness.runtime.audit import content_hash; "
            "print(json.dumps({k: content_hash(v) for k, v in items().items()}))")
    import json

    mine = {k: content_hash(v) for k, v in items().items()}  # this process: a random hash seed
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONHASHSEED": "1"}, timeout=50)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == mine
