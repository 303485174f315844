"""Spec validation: every mistake is named by its path, with a fix."""

from __future__ import annotations

import pytest

from elastic_harness.errors import SpecError
from elastic_harness.spec import describe, dump_job, load_job, parse_job
from tests.conftest import JOBS


@pytest.mark.parametrize("job", sorted(JOBS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_jobs_load_and_round_trip(job):
    spec = load_job(job)
    assert parse_job(dump_job(spec)) == spec


@pytest.mark.parametrize(
    "text, path, words",
    [
        ("trian: {}", "trian", "did you mean 'train'"),
        ("train: {stpes: 3}", "train.stpes", "did you mean 'steps'"),
        ("nodes: {min: 3, max: 2}", "nodes", "greater than max"),
        ("checkpoint: {keep: 1}", "checkpoint.keep", ">= 2"),
        ("parallelism: fsd", "parallelism", "did you mean 'fsdp'"),
        ("train: {steps: true}", "train.steps", "integer"),
        ("train: {steps: 0}", "train.steps", "> 0"),
        ("train: {global_batch_size: -4}", "train.global_batch_size", "> 0"),
        ("train: {micro_batch_size: 2.5}", "train.micro_batch_size", "integer"),
        ("optimizer: {lr: '1e-3x'}", "optimizer.lr", "number"),
        ("optimizer: {betas: [0.9]}", "optimizer.betas", "two numbers"),
        ("task: {target: no_colon}", "task.target", "package.module:callable"),
        ("rendezvous: {endpoint: hostonly}", "rendezvous.endpoint", "no port"),
        ("chaos: [{kind: kill-worker}]", "chaos[]", "neither at_step"),
        ("chaos: [{kind: explode, at_step: 2}]", "chaos[0].kind", "not one of"),
        ("nproc_per_node: 4\nnodes: {max: 2}\ntrain: {global_batch_size: 6}",
         "train.global_batch_size", "at least 8"),
    ],
)
def test_bad_values_name_the_field(text, path, words):
    with pytest.raises(SpecError) as e:
        parse_job(text)
    assert e.value.path == path
    assert words in str(e.value)


def test_malformed_yaml_gives_line():
    with pytest.raises(SpecError, match="not valid YAML at line"):
        parse_job("name: x\ntrain: {steps: 3\nseed: [1\n")


def test_top_level_must_be_mapping():
    with pytest.raises(SpecError, match="mapping"):
        parse_job("- a\n- b\n")


def test_overrides_are_typed_and_checked():
    spec = parse_job("name: x\ntask: {target: 'a.b:C'}", ["train.steps=7", "optimizer.lr=0.5", "checkpoint.async_save=false"])
    assert spec.train.steps == 7 and spec.optimizer.lr == 0.5 and spec.checkpoint.async_save is False
    with pytest.raises(SpecError, match="train.stpes"):
        parse_job("name: x\ntask: {target: 'a.b:C'}", ["train.stpes=7"])
    with pytest.raises(SpecError, match="KEY.PATH=VALUE"):
        parse_job("name: x", ["train.steps"])


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_job(tmp_path / "nope.yaml")


def test_every_field_is_documented():
    rows = describe()
    assert len(rows) > 40
    undocumented = [key for key, _, text in rows if not text]
    assert undocumented == []


def test_exponent_numbers_are_numbers_not_strings():
    """PyYAML (YAML 1.1) reads `1e-3` as a string; a job, its --set values and task args
    read it as the number a user means (YAML 1.2)."""
    spec = parse_job("task: {target: 'a.b:C', args: {lr: 2E-4}}\n"
                     "optimizer: {lr: 1e-3, warmup_steps: 1e2}\ntrain: {steps: 1.0e3}\n",
                     ["optimizer.weight_decay=1e-2"])
    assert spec.optimizer.lr == 1e-3 and spec.optimizer.weight_decay == 1e-2
    assert spec.optimizer.warmup_steps == 100 and isinstance(spec.optimizer.warmup_steps, int)
    assert spec.train.steps == 1000 and spec.task.args["lr"] == 2e-4
    assert parse_job("task: {target: 'a.b:C'}\nname: '1e3'\n").name == "1e3"  # quoted stays text
    with pytest.raises(SpecError, match="must be an integer"):
        parse_job("task: {target: 'a.b:C'}\ntrain: {steps: 1.55e1}\n")


def test_a_bad_spec_reports_every_problem_at_once():
    text = "task: {target: 'a.b:C'}\nbogus: 1\ntrain: {stpes: 20, seed: x}\noptimizer: {lr: abc}\n" \
           "nodes: {min: 0}\nchaos: [{kind: kill-worker, at_step: 0}, {kind: nope, at_step: 3}]\n"
    with pytest.raises(SpecError) as e:
        parse_job(text)
    text_out = str(e.value)
    for where in ("bogus: unknown key", "train.stpes: unknown key", "did you mean 'steps'",
                  "train.seed: must be an integer", "optimizer.lr: must be a number", "nodes.min",
                  "neither at_step nor at_seconds", "chaos[1].kind"):
        assert where in text_out, (where, text_out)
    assert text_out.startswith("job spec error: 7 problems")
    assert e.value.path == "bogus"


def test_a_removed_key_says_when_and_what_instead_not_unknown_key():
    """``checkpoint.writer`` went in 0.3 (issue 34): ``process`` is refused with one line that
    says so and what to use; ``thread``, what it did by default and what happens now (every
    0.2 resolved spec records it), still loads."""
    task = "task: {target: 'a.b:C'}\n"
    with pytest.raises(SpecError) as e:
        parse_job(task + "checkpoint: {writer: process}\n")
    assert e.value.path == "checkpoint.writer"
    assert "removed in 0.3" in str(e.value) and "unknown key" not in str(e.value)
    assert "background thread" in e.value.hint and "delete the key" in e.value.hint
    old = parse_job(task + "checkpoint: {writer: thread, keep: 4}\n")
    assert old.checkpoint.keep == 4 and not hasattr(old.checkpoint, "writer")
    with pytest.raises(SpecError, match="removed in 0.3"):
        parse_job(task, ["checkpoint.writer=process"])


# ----- YAML 1.2 scalars and keys given twice (issue 33, item 4) ------------------------------
def test_a_key_given_twice_is_named_with_both_lines():
    text = "name: x\ntask: {target: 'a.b:C'}\nnproc_per_node: 2\ntrain: {steps: 3}\nnproc_per_node: 4\n"
    with pytest.raises(SpecError) as e:
        parse_job(text, source="job.yaml")
    assert e.value.path == "nproc_per_node"
    assert "nproc_per_node: given twice, at lines 3 and 5" in str(e.value) and "keep one" in e.value.hint
    for nested, path in (("train:\n  steps: 3\n  seed: 1\n  steps: 4\n", "train.steps"),
                         ("train: {steps: 3, steps: 4}\n", "train.steps"),
                         ("chaos:\n  - {kind: hang, at_step: 2, at_step: 3}\n", "chaos[0].at_step")):
        with pytest.raises(SpecError, match="given twice") as e:
            parse_job("name: x\ntask: {target: 'a.b:C'}\n" + nested)
        assert e.value.path == path


def test_a_merge_key_may_be_overridden_once():
    """A key merged in with ``<<`` and then given is an override, not a duplicate."""
    from elastic_harness.spec.loader import _yaml

    assert _yaml("b: &b {x: 1, y: 2}\nd: {<<: *b, x: 3}\n")["d"] == {"x": 3, "y": 2}


@pytest.mark.parametrize("text, value", [
    ("no", "no"), ("yes", "yes"), ("on", "on"), ("off", "off"), ("Y", "Y"), ("true", True), ("False", False),
    ("010", 10), ("0o17", 15), ("0x1f", 31), ("1_000", 1000), ("1:30", "1:30"), ("2024-01-31", "2024-01-31"),
    ("1e3", 1000.0), (".5", 0.5), ("~", None),
])
def test_scalars_read_as_yaml_1_2(text, value):
    """PyYAML's YAML 1.1 makes ``no`` False, ``010`` eight, ``1:30`` ninety and
    ``2024-01-31`` a date; the job loader reads them as YAML 1.2 does."""
    from elastic_harness.spec.loader import _yaml

    got = _yaml(f"v: {text}")["v"]
    assert got == value and type(got) is type(value)


def test_name_no_is_a_name_and_yes_for_a_flag_says_true_or_false():
    spec = parse_job("name: no\ntask: {target: 'a.b:C', args: {flag: on}}\n")
    assert spec.name == "no" and spec.task.args == {"flag": "on"}
    assert parse_job(dump_job(spec)) == spec, "dumped quoted: the name stays a string in any YAML"
    with pytest.raises(SpecError) as e:
        parse_job("name: x\ntask: {target: 'a.b:C'}\nmetrics: {tensorboard: yes}\n")
    assert "metrics.tensorboard: must be true or false, got 'yes'" in str(e.value)
    assert "yes/no/on/off are text" in e.value.hint


@pytest.mark.parametrize("word", ["no", "on", "1e3", "0o17", "1:30", "2024-01-31", "010", "true"])
def test_dumped_strings_read_back_as_strings_in_both_yaml_dialects(word):
    import yaml

    text = dump_job(parse_job(f"name: x\ntask: {{target: 'a.b:C', args: {{v: '{word}'}}}}\n"))
    assert parse_job(text).task.args["v"] == word
    assert yaml.safe_load(text)["task"]["args"]["v"] == word, "YAML 1.1 readers (kubectl's, PyYAML's) too"


DIALECT = """
name: no
a: 010
b: 1e3
c: 1:30
d: 2024-01-31
e: 0x1f
f: [on, off, yes, True, .inf, ~]
g: &anchor {h: 1_000}
i: {<<: *anchor, j: -0b101}
"""


@pytest.mark.parametrize("job", [*sorted(JOBS.glob("*.yaml")), "dialect"], ids=lambda p: getattr(p, "name", p))
def test_libyaml_loader_reads_every_job_as_the_python_loader_does(job):
    from elastic_harness.spec import loader

    text = DIALECT if job == "dialect" else job.read_text()
    assert loader._load(loader._FastLoader, text) == loader._load(loader._Loader, text)
    assert "CParser" in [c.__name__ for c in loader._FastLoader.__mro__]  # the fast path is in use


def test_prepare_resolves_every_schema_type_a_job_reads(monkeypatch):
    """``prepare`` (the zygote runs it before forking workers) resolves the field types of
    the whole schema, so a worker reading any shipped job never resolves one again (each
    resolution compiles the annotation strings: milliseconds of every worker's start)."""
    import typing

    from elastic_harness.spec import loader

    loader.shape_of.cache_clear()
    loader.prepare()

    def resolve_again(*a, **k):
        raise AssertionError(f"resolved {a[0]} after prepare()")

    monkeypatch.setattr(typing, "get_type_hints", resolve_again)
    for job in sorted(JOBS.glob("*.yaml")):
        assert load_job(job).name, job


def test_a_job_file_that_is_not_utf8_is_one_line_and_utf16_with_a_mark_is_read(tmp_path):
    """Latin-1 (`name: café`) and UTF-16 from a Windows shell raised UnicodeDecodeError from
    the loader. UTF-16 (or UTF-8) with a byte-order mark is read, as YAML allows; anything
    else that is not UTF-8 is one line naming the byte, where it is, and the fix."""
    from elastic_harness.errors import SpecError
    from elastic_harness.spec import load_job

    text = "name: café\ntask: {target: 'elastic_harness.tasks.mlp:MLPRegression'}\n"
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(text.encode("latin-1"))
    with pytest.raises(SpecError) as e:
        load_job(latin1)
    assert "is not UTF-8 text (byte 0xe9 on line 1, column 10)" in e.value.message and "UTF-8" in e.value.hint
    for encoding in ("utf-16", "utf-8-sig"):  # a byte-order mark says which
        marked = tmp_path / f"{encoding}.yaml"
        marked.write_bytes(text.encode(encoding))
        assert load_job(marked).name == "café"
    broken = tmp_path / "broken.yaml"
    broken.write_bytes(b"\xff\xfe" + b"\x00\xd8")  # a UTF-16 mark, then a lone surrogate
    with pytest.raises(SpecError, match="is not UTF-8 text"):
        load_job(broken)


@pytest.mark.parametrize("override, words", [
    ("timeouts.process_group=1e20", "timeouts.process_group: must be at most 604800 (7 days), got 1e+20"),
    ("rendezvous.join_timeout=1e20", "rendezvous.join_timeout: must be at most 604800 (7 days)"),
    ("rendezvous.isolation_timeout=1e9", "rendezvous.isolation_timeout: must be at most 604800"),
    ("timeouts.step=.inf", "timeouts.step: must be a finite number, got inf"),
    ("timeouts.step=.nan", "timeouts.step: must be a finite number, got nan"),
    ("rendezvous.keep_alive_max_attempt=100000", "rendezvous.keep_alive_max_attempt: must be at most 1000"),
    ("checkpoint.every_seconds=1e12", "checkpoint.every_seconds: must be at most 604800"),
])
def test_timeouts_have_upper_bounds_that_name_the_field(override, words):
    """timeouts.process_group=1e20 crash-looped on OverflowError without naming the field;
    rendezvous.join_timeout=1e20 printed only "agents exited with {0: 1}"."""
    with pytest.raises(SpecError) as e:
        load_job(JOBS / "mlp.yaml", [override])
    assert words in e.value.message and e.value.hint.startswith(("set ", "write "))
    assert load_job(JOBS / "mlp.yaml", ["timeouts.process_group=604800", "timeouts.step=0"]).timeouts.step == 0


@pytest.mark.parametrize("endpoint, words", [
    ("http://127.0.0.1:2379", "'http://127.0.0.1:2379' has a scheme (http://)"),
    ("127.0.0.1:abc", "port 'abc' is not a number from 1 to 65535"),
    ("127.0.0.1:70000", "port '70000' is not a number"),
    ("h1:2379,:2379", "':2379': '' is not a host name or address"),
    ("127.0.0.1", "'127.0.0.1' has no port"),
])
def test_rendezvous_endpoints_are_checked_in_the_spec(endpoint, words):
    """`rendezvous.endpoint: http://127.0.0.1:2379` read as a DNS failure (exit 200) and
    `127.0.0.1:abc` printed only "agents exited with {0: 2}": each is one line before anything
    starts."""
    with pytest.raises(SpecError) as e:
        parse_job("task: {target: 'a.b:C'}\n", ["rendezvous.backend=etcd", f"rendezvous.endpoint={endpoint}"])
    assert e.value.path == "rendezvous.endpoint" and words in e.value.message
    assert "HOST:PORT" in e.value.hint or "etcd_protocol" in e.value.hint
    ok = parse_job("task: {target: 'a.b:C'}\n", ["rendezvous.endpoint=h1:2379,h2:2379"])
    assert ok.rendezvous.endpoint == "h1:2379,h2:2379"
    assert parse_job("task: {target: 'a.b:C'}\nrendezvous: {endpoint: '[::1]:2379'}\n").rendezvous.endpoint == "[::1]:2379"
