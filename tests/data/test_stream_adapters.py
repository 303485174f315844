"""Adapters at the edge (``data.adapters``), the content audit's hash, the saved stream
position's checks, and the stream loader in and out of loader processes (fast tier)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elastic_harness.data import Packing, Stream, jsonl_stream, parquet_stream, tar_stream
from elastic_harness.data.adapters import hf_stream, source_of
from elastic_harness.data.order import Layout, StreamOrder
from elastic_harness.data.read import LaneReaders
from elastic_harness.data.sampler import DataState
from elastic_harness.errors import UsageError
from elastic_harness.runtime.audit import content_hash
from elastic_harness.runtime.loader import LoaderSettings, StreamLoader, stream_planner
from elastic_harness.runtime.state import TrainState
from elastic_harness.tasks.streamlm import build_corpus, ids_of, shard_docs, stdlib_documents

pytestmark = pytest.mark.timeout(120)


# ----- what run.steps() may be given ---------------------------------------------------------
class Shardless(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from range(3)


class Sharded(torch.utils.data.IterableDataset):
    shards = ["a", "b"]

    def open_shard(self, shard):
        return iter([f"{shard}{i}" for i in range(3)])

    def __iter__(self):
        for s in self.shards:
            yield from self.open_shard(s)


class NoLen(torch.utils.data.Dataset):
    def __getitem__(self, i):
        return i


@pytest.mark.parametrize("obj, words", [
    (torch.utils.data.DataLoader(list(range(4)), batch_size=2), "a DataLoader, which is a loader"),
    (Shardless(), "exposes no shards"),
    (NoLen(), "has [i] but no len()"),
    (iter(range(3)), "neither a dataset nor a stream"),
])
def test_what_cannot_be_resumed_is_refused_with_the_fix(obj, words):
    with pytest.raises(UsageError) as e:
        source_of(obj)
    assert words in e.value.message and e.value.hint


def test_a_stateful_dataloader_is_refused_like_a_dataloader():
    class StatefulDataLoader(torch.utils.data.DataLoader):  # torchdata's is a DataLoader subclass
        pass

    with pytest.raises(UsageError, match="loader, not a dataset"):
        source_of(StatefulDataLoader(list(range(4))))


def test_map_style_and_sharded_iterables_are_taken():
    data = list(range(5))
    assert source_of(data) is data
    stream = source_of(Sharded())
    assert isinstance(stream, Stream) and stream.shards == ["a", "b"]
    assert list(stream.samples(1, 1)) == ["b1", "b2"]


# ----- file formats: the same documents whatever the layout ----------------------------------
@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    pytest.importorskip("pyarrow")
    root = tmp_path_factory.mktemp("corpora")
    return {fmt: build_corpus(str(root / fmt), 4, 24, fmt) for fmt in ("jsonl", "tar", "parquet")}


def test_every_layout_reads_the_same_documents_and_sizes(corpora):
    docs = shard_docs(stdlib_documents(24), 4)
    streams = {"jsonl": jsonl_stream(corpora["jsonl"]), "tar": tar_stream(corpora["tar"]),
               "parquet": parquet_stream(corpora["parquet"])}
    for fmt, stream in streams.items():
        for i in range(4):
            assert [ids_of(s) for s in stream.samples(i)] == docs[i], fmt
            assert stream.units(i) == len(docs[i]), fmt
            assert [ids_of(s) for s in stream.samples(i, 2)] == docs[i][2:], fmt


def test_hugging_face_streaming_dataset_over_local_jsonl(corpora):
    datasets = pytest.importorskip("datasets")
    ds = datasets.load_dataset("json", data_files=corpora["jsonl"], split="train", streaming=True)
    stream = source_of(ds)
    assert len(stream.shards) == 4 and stream.shards[2][1].endswith("shard-002.jsonl")
    plain = jsonl_stream(corpora["jsonl"])
    for i in range(4):
        assert [ids_of(s) for s in stream.samples(i, 1)] == [ids_of(s) for s in plain.samples(i, 1)]
    assert hf_stream(ds, lanes=3).lanes == 3


def test_packed_streams_agree_across_layouts(corpora):
    seq = 17
    orders = {}
    for fmt, make in (("jsonl", jsonl_stream), ("tar", tar_stream), ("parquet", parquet_stream)):
        stream = make(corpora[fmt], pack=Packing(seq, ids_of))
        units = tuple(stream.units(i) for i in range(4))
        order = StreamOrder(3, Layout(units, seq, 3, 2))
        readers = LaneReaders(stream, order)
        orders[fmt] = [readers.read(p) for p in range(0, order.n, 7)]
    for fmt in ("tar", "parquet"):
        assert [a[:2] for a in orders[fmt]] == [a[:2] for a in orders["jsonl"]]
        assert all(np.array_equal(a[2], b[2]) for a, b in zip(orders[fmt], orders["jsonl"], strict=True))


# ----- the content audit's hash ----------------------------------------------------------------
def test_content_hash_tells_data_apart_and_is_stable():
    a = {"x": torch.arange(4), "y": np.array([1.5, 2.0]), "t": "doc"}
    assert content_hash(a) == content_hash({"t": "doc", "y": np.array([1.5, 2.0]), "x": torch.arange(4)})
    assert content_hash(a) != content_hash({**a, "x": torch.arange(1, 5)})
    assert content_hash(torch.arange(4)) != content_hash(torch.arange(4).float())
    assert content_hash((torch.zeros(2), torch.ones(1))) != content_hash((torch.ones(1), torch.zeros(2)))
    assert len(content_hash(b"bytes")) == 16


# ----- the saved position -------------------------------------------------------------------
def test_saved_stream_position_refuses_another_shard_list_or_order():
    saved = TrainState(DataState(0, 100, 40), 2, step=4)
    saved.stream, saved.order_digest = 11, 22
    assert {"stream", "layout"} <= saved.state_dict().keys()  # the keys every stream checkpoint holds
    loaded = TrainState(DataState(0, 0), 3)
    loaded.load_state_dict(saved.state_dict())
    assert (loaded.stream, loaded.order_digest, loaded.data.cursor) == (11, 22, 40)
    assert loaded.check_matches(0, 100, 11, 22) is None
    assert "shard list changed" in loaded.check_matches(0, 100, 12, 22)
    assert "order changed" in loaded.check_matches(0, 100, 11, 23)
    assert "now gives a map-style dataset" in loaded.check_matches(0, 100, 0, 0)


# ----- the loader: loader processes change nothing ----------------------------------------------
def counting_stream():
    units = (5, 9, 2, 7)
    return Stream(list(range(4)), lambda i: (torch.tensor([i, j]) for j in range(units[i])),
                  lengths=units, transform=lambda t: torch.cat([t, torch.randint(0, 1000, (1,))])), units


@pytest.mark.parametrize("world", [1, 3])
def test_stream_loader_with_processes_matches_without(world):
    stream, units = counting_stream()
    order = StreamOrder(1, Layout(units, 1, 6, 2))
    g, steps = 6, 8

    def batches(workers, rank, first=0):
        plan_of = stream_planner(order, first * g, first, g, world, rank, 2)
        settings = LoaderSettings(seed=5, device=torch.device("cpu"), collate=None, workers=workers,
                                  prefetch=2, pin_memory=False, record=True)
        loader = StreamLoader(stream, order, plan_of, first, steps, dp_size=world, settings=settings)
        out = []
        for _ in range(first, steps):
            plan, got = loader.next_step()
            out.append((plan, [b.tolist() for b in got], loader.meta))
        loader.close()
        return out

    for rank in range(world):
        ref = batches(0, rank)
        assert batches(2, rank) == ref
        assert batches(0, rank, first=3) == ref[3:], "a restart at step 3 continues identically"
        for _plan, got, meta in ref:
            rows = [row for b in got for row in b]
            assert [(s, o) for s, o, _ in rows] == [tuple(i) for i, _ in meta]  # identity = data


# ----- the audit catches a source that returns other data than its position says ---------------
class IgnoresIndex(torch.utils.data.Dataset):
    """The tempting workaround: a 'map-style' wrapper returning the stream's next item."""

    def __init__(self):
        self.next = 0

    def __len__(self):
        return 20

    def __getitem__(self, i):
        self.next += 1
        return torch.tensor([self.next])


class Honest(IgnoresIndex):
    def __getitem__(self, i):
        return torch.tensor([i * 7])


@pytest.mark.parametrize("dataset, caught", [(IgnoresIndex, True), (Honest, False)])
def test_content_audit_catches_data_that_does_not_follow_its_index(tmp_path, dataset, caught):
    from elastic_harness.data.sampler import EpochOrder
    from elastic_harness.runtime.audit import Writer, record_samples
    from elastic_harness.runtime.loader import StepLoader, planner
    from tests.audit import content_audit

    (tmp_path / "samples").mkdir()
    order, g, steps = EpochOrder(0, 20), 4, 8

    def attempt(generation, first, last):  # a fresh process resumes at `first`
        plan_of = planner(order, first * g, first, g, 1, 0, 2)
        loader = StepLoader(dataset(), plan_of, first, last,
                            LoaderSettings(seed=0, device=torch.device("cpu"), collate=None, workers=0,
                                           prefetch=2, pin_memory=False, record=True))
        for step in range(first, last):
            plan, _ = loader.next_step()
            record_samples(tmp_path / "samples" / "rank-0.jsonl", Writer(generation, 0, 1), step + 1, plan,
                           loader.meta)

    attempt("a", 0, 5)  # killed after step 5, resumed from a checkpoint at step 3
    attempt("b", 3, steps)
    if caught:
        with pytest.raises(AssertionError, match="held different"):
            content_audit(tmp_path, 20, g, steps)
    else:
        assert content_audit(tmp_path, 20, g, steps)["epochs"] == 2


def test_a_shard_that_cannot_be_counted_is_retried_then_named(tmp_path):
    from elastic_harness.data.read import DataError
    from elastic_harness.runtime.stream_index import Counting, shard_units

    (tmp_path / "a.jsonl").write_text('{"ids": [1]}\n')
    (tmp_path / "b.jsonl").mkdir()  # exists, cannot be opened
    stream = jsonl_stream([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], retries=2)
    with pytest.raises(DataError, match=r"shard 1 \('.*b.jsonl'\) cannot be read after 2 tries"):
        shard_units(stream, Counting(rank=0, world_size=1, group=None, cache_dir=tmp_path / "cache"))
    ok = jsonl_stream([tmp_path / "a.jsonl"])
    assert shard_units(ok, Counting(rank=0, world_size=1, group=None, cache_dir=tmp_path / "cache")) == [1]
    assert list((tmp_path / "cache").glob("units-*.json")), "counted once, then cached"


def test_bench_stream_shards_read_back_as_written(tmp_path):
    from elastic_harness.bench.throughput.stream import decode, write_shards

    paths = write_shards(tmp_path, 2, 5)
    stream = tar_stream(paths)
    assert [stream.units(i) for i in range(2)] == [5, 5]
    x, y = decode(next(stream.samples(1, 4)))
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 0 <= y < 10


def test_a_corpus_that_cannot_be_built_where_the_job_says_is_a_data_error(tmp_path):
    """Not an OSError that a restart repeats (a crash loop): one line naming the fix."""
    from elastic_harness.data.read import DataError
    from elastic_harness.tasks.streamlm import build_corpus

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(DataError, match="cannot be written") as e:
        build_corpus(str(blocker / "corpus"), 2, 4, "jsonl")
    assert "shard-000.jsonl .. shard-001.jsonl" in e.value.message and "writable" in e.value.hint
    names = build_corpus(str(tmp_path / "ok"), 2, 4, "jsonl")  # built once, then only read
    (tmp_path / "ok").chmod(0o555)
    try:
        assert build_corpus(str(tmp_path / "ok"), 2, 4, "jsonl") == names
    finally:
        (tmp_path / "ok").chmod(0o755)
