"""Streaming end to end: packed token shards (jsonl, Hugging Face streaming, tar, S3) killed
mid-shard, resized 2 -> 3 -> 1, and refused when the shards changed.

One uninterrupted reference at 2 ranks (jsonl); every killed run must end bit-identical to
it (the layouts hold the same documents, so the Hugging Face and S3 runs too), resized runs
within tolerance; ``tests.audit.content_audit`` checks, from each sample's identity and
content hash, that every position held the same sample as in the reference and that no
sample repeats within an epoch.
"""

from __future__ import annotations

import pytest

from elastic_harness.checkpoint.offline import compare
from tests.audit import content_audit
from tests.checkpoint.test_s3 import s3_env  # noqa: F401 - the moto S3 server fixture
from tests.cli.test_bad_input import tree_digest
from tests.conftest import JOBS, REPO, cli, final_ckpt, model_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

JOB = JOBS / "stream_lm.yaml"
STEPS, G = 30, 12
RESIZE_ATOL = 2e-4  # vs parameter moves of ~0.1 in these 30 AdamW steps at lr 3e-3
EPOCH = 200  # packed 33-token sequences per epoch of this corpus (16 documents, 6 shards)


def assert_clear_error(r, *words):
    """Exit 2 and one ``error:`` line naming the problem (a resume may be reported before the
    data is bound and checked: the line need not be the first)."""
    assert r.code == 2, (r.code, r.err)
    assert "Traceback" not in r.err and "Traceback" not in r.out
    (line,) = [x for x in r.err.splitlines() if x.startswith("error: ")]
    for w in words:
        assert w in r.err, (w, r.err)
    return line


def args(data_dir, fmt="jsonl", shards=6, steps=STEPS):
    task = (f"{{data_dir: '{data_dir}', format: {fmt}, shards: {shards}, max_docs: 16, lanes: 6, "
            "window: 2, block_size: 32, dim: 32, layers: 1, heads: 2}")
    return ["--set", f"task.args={task}", "--set", f"train.steps={steps}", "--set", "checkpoint.every_steps=6",
            "--set", "train.record_samples=true", "--set", "data.workers=1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus")


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("stream-ref")
    r = cli("run", str(JOB), *args(corpus / "jsonl"), run_dir=run_dir)
    assert r.code == 0, r.err
    return r


@pytest.mark.xdist_group("stream-reference")  # computed once, on one worker
@pytest.mark.compat  # .ci/compat's end-to-end set (docs/torch-versions.md)
def test_packed_jsonl_killed_mid_shard_is_bit_identical(reference, corpus, tmp_path):
    r = cli("run", str(JOB), *args(corpus / "jsonl"), "--chaos", "kill-worker:1@16", run_dir=tmp_path)
    assert r.code == 0, r.err
    assert r.summary["model_digest"] == reference.summary["model_digest"]
    (resume,) = [e for e in r.kinds("resume") if not e.get("fresh")]
    assert 12 <= resume["step"] <= 16  # a checkpoint or an in-memory snapshot, mid-shard
    seen = content_audit(tmp_path, EPOCH, G, STEPS, reference=reference.run_dir, packed=True)
    assert seen["epochs"] == 2, "the run crosses an epoch boundary"


@pytest.mark.xdist_group("stream-reference")  # computed once, on one worker
def test_stopped_at_2_resumed_at_3_then_1_uses_each_sample_once(reference, corpus, tmp_path):
    common = args(corpus / "jsonl")
    first = cli("run", str(JOB), *common, "--chaos", "preempt:0@8", run_dir=tmp_path)
    assert first.code == 143, first.err
    second = cli("run", str(JOB), *common, "--nproc-per-node", "3", "--set", "data.workers=2",
                 "--chaos", "preempt:0@8", "--chaos", "preempt:0@19", run_dir=tmp_path)  # fault 0 fired
    assert second.code == 143, second.err
    third = cli("run", str(JOB), *common, "--nproc-per-node", "1", "--set", "data.workers=0", run_dir=tmp_path)
    assert third.code == 0, third.err
    seen = content_audit(tmp_path, EPOCH, G, STEPS, reference=reference.run_dir, packed=True)
    assert {seen["world_sizes"][s] for s in (1, 12, 30)} == {2, 3, 1}
    # Another world size sums gradients in another order: float32 rounding, which AdamW's
    # normalisation lifts to ~1e-5 on near-zero parameters (the MLP tests' rtol is too tight).
    diff = compare(model_of(final_ckpt(tmp_path)), model_of(final_ckpt(reference.run_dir)))
    assert diff["comparable"] and diff["max_abs"] < RESIZE_ATOL, diff

    # The shard list changed since the checkpoint: one line, exit 2, checkpoints untouched.
    before = tree_digest(tmp_path / "checkpoints")
    changed = cli("run", str(JOB), *args(corpus / "jsonl5", shards=5, steps=36), run_dir=tmp_path)
    assert_clear_error(changed, "shard list changed since the checkpoint")
    # The cause is what the user reads: no "resumed from" before (or without) it.
    assert "resumed from" not in changed.out + changed.err
    assert tree_digest(tmp_path / "checkpoints") == before


@pytest.mark.xdist_group("stream-reference")  # computed once, on one worker
def test_hugging_face_streaming_dataset_killed_matches_the_jsonl_reference(reference, corpus, tmp_path):
    pytest.importorskip("datasets")
    r = cli("run", str(JOB), *args(corpus / "jsonl", fmt="hf"), "--chaos", "kill-worker:0@11", run_dir=tmp_path)
    assert r.code == 0, r.err
    assert r.summary["model_digest"] == reference.summary["model_digest"]
    content_audit(tmp_path, EPOCH, G, STEPS, reference=reference.run_dir, packed=True)


def test_tar_shards_in_a_script_killed_mid_shard_bit_identical(corpus, tmp_path):
    job = JOBS / "stream_script.yaml"
    small = ["--set", "train.steps=20", "--set", "checkpoint.every_steps=5", "--set", "train.record_samples=true",
             "--set", f"script.args=[--format, tar, --data-dir, '{corpus / 'tar'}', --max-docs, '16', --lanes, '6']"]
    ref = cli("run", str(job), *small, run_dir=tmp_path / "ref")
    assert ref.code == 0, ref.err
    killed = cli("run", str(job), *small, "--chaos", "kill-worker:1@12", run_dir=tmp_path / "killed")
    assert killed.code == 0, killed.err
    assert killed.summary["model_digest"] == ref.summary["model_digest"]
    content_audit(tmp_path / "killed", EPOCH, G, 20, reference=tmp_path / "ref", packed=True)


def test_a_dataloader_given_to_run_steps_is_one_line(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(f"name: mistake\nscript: {{path: {REPO / 'tests/scripts/mistakes.py'}, "
                   "args: [--mistake, dataloader]}\nnproc_per_node: 2\n"
                   "train: {steps: 4, global_batch_size: 4, micro_batch_size: 2}\n")
    r = cli("run", str(job), run_dir=tmp_path / "run")
    assert_clear_error(r, "DataLoader, which is a loader, not a dataset", "loader.dataset")
    assert "crash loop" not in r.err


@pytest.mark.xdist_group("stream-reference")  # computed once, on one worker
def test_shards_on_the_s3_compatible_server(reference, s3_env, tmp_path):  # noqa: F811
    r = cli("run", str(JOB), *args("s3://eh-ckpts/stream-corpus"), "--chaos", "kill-worker:1@9",
            run_dir=tmp_path, env=s3_env)
    assert r.code == 0, r.err
    assert r.summary["model_digest"] == reference.summary["model_digest"]
    content_audit(tmp_path, EPOCH, G, STEPS, reference=reference.run_dir, packed=True)


@pytest.fixture
def read_only(tmp_path):
    """A read-only mount (root only: permission bits do not stop root; skipped, saying why)."""
    from tests.servers import tmpfs

    with tmpfs(tmp_path / "read-only", "ro,size=64k") as mnt:
        yield mnt


def test_a_read_only_data_dir_without_the_corpus_is_one_line_not_a_crash_loop(tmp_path, read_only):
    """Issue 33: it crash-looped 'after resuming from the same checkpoint' with no checkpoint."""
    r = cli("run", str(JOB), *args(read_only / "corpus"), run_dir=tmp_path / "run")
    line = assert_clear_error(r, f"data_dir '{read_only / 'corpus'}' cannot be written", "Read-only file system",
                              "shard-000.jsonl .. shard-005.jsonl")
    assert "crash loop" not in r.err and "checkpoint to resume" not in r.err and "failure:" not in r.err, r.err
    assert line.startswith("error: data_dir")
    assert len([e for e in r.kinds("worker") if e["rank"] == 0]) == 1  # not restarted
