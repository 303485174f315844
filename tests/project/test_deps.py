"""The install: torch in the proven range (torchcompat), small core, extras that answer with one
line naming themselves."""

from __future__ import annotations

import subprocess
import sys

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as pip vendors it
    from pip._vendor import tomli as tomllib

from elastic_harness import deps
from elastic_harness.spec import parse_job
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
SMALL = "name: d\ntask: {target: elastic_harness.tasks.mlp:MLPRegression}\ntrain: {steps: 2}\n"


def test_torch_range_is_the_one_the_host_checks():
    """pyproject.toml's torch requirement is ``torchcompat.release.RANGE``."""
    from elastic_harness.torchcompat import release

    assert f"torch{release.RANGE}" in PROJECT["dependencies"]


def test_core_install_is_small_and_all_covers_every_extra():
    core = " ".join(PROJECT["dependencies"])
    for heavy in ("s3fs", "tensorboard", "matplotlib", "python-etcd"):
        assert heavy not in core
    extras = PROJECT["optional-dependencies"]
    assert set(deps.EXTRAS) <= set(extras)
    (everything,) = extras["all"]
    assert set(deps.EXTRAS) <= set(everything.split("[")[1].rstrip("]").split(","))
    assert PROJECT["license"] == "Apache-2.0" and (REPO / "LICENSE").read_text().count("Apache License") >= 1


def test_extras_a_spec_uses():
    assert deps.extras_for(parse_job(SMALL)) == []
    spec = parse_job(SMALL + "checkpoint: {dir: 's3://b/p'}\nmetrics: {tensorboard: true}\n"
                     "rendezvous: {backend: etcd-v2, endpoint: 'h:2379'}\n")
    assert deps.extras_for(spec) == ["s3", "tensorboard", "etcd"]
    # etcd's v3 API is spoken without a client library (rendezvous.etcd_gateway)
    assert deps.extras_for(parse_job(SMALL + "rendezvous: {backend: etcd, endpoint: 'h:2379'}\n")) == []


def _without(module: str, *argv: str, cwd=None) -> subprocess.CompletedProcess:
    """``elastic-harness ARGV`` in a Python where ``module`` cannot be imported."""
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            "from elastic_harness.cli import main\n"
            f"sys.exit(main({list(argv)!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=100, cwd=cwd or REPO)


def test_report_without_matplotlib_prints_the_text_and_names_the_extra(tmp_path):
    """On the core install `report RUN` exited 2 for want of matplotlib: the text report needs
    none, so it is printed, with one note naming the extra for report.png."""
    (tmp_path / "events.jsonl").write_text('{"event": "start", "who": "host", "t": 0}\n'
                                           '{"event": "step", "step": 1, "loss": 1.0, "t": 1}\n')
    r = _without("matplotlib", "report", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "goodput" in r.stdout and "no failures" in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("note: no report.png"), r.stderr
    assert "pip install 'elastic-harness[report]'" in lines[0] and "Traceback" not in r.stderr
    assert not (tmp_path / "report.png").exists()


def test_run_with_tensorboard_missing_names_the_extra_before_any_agent(tmp_path):
    job = tmp_path / "j.yaml"
    job.write_text(SMALL + "metrics: {tensorboard: true}\n")
    r = _without("tensorboard", "run", str(job), "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "pip install 'elastic-harness[tensorboard]'" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()  # refused before the run dir was made


def test_bench_throughput_without_pillow_names_the_extra(tmp_path):
    """The core install has no Pillow; the bench's images need it (issue 33, item 2)."""
    r = _without("PIL", "bench", "throughput", "--repeats", "1", "--dir", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'elastic-harness[bench]'" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and list(tmp_path.iterdir()) == [], "refused before any scratch dir"
    assert "bench" in PROJECT["optional-dependencies"]["all"][0]


# Where each third-party module the package imports comes from: a core dependency or an
# extra (pyproject.toml). A module missing here is an undeclared dependency.
PROVIDED_BY = {
    "torch": "torch", "numpy": "numpy", "yaml": "pyyaml", "fsspec": "fsspec",
    "prometheus_client": "prometheus_client", "safetensors": "safetensors",
    "s3fs": "s3fs", "tensorboard": "tensorboard", "matplotlib": "matplotlib", "etcd": "python-etcd",
    "urllib3": "python-etcd",  # python-etcd's own client library, used beside it (agent/isolation.py)
    "transformers": "transformers", "datasets": "datasets", "pyarrow": "pyarrow", "PIL": "Pillow",
    "torchft": "torchft",
}


def test_every_third_party_import_is_declared():
    import ast

    declared = " ".join([*PROJECT["dependencies"],
                         *(d for name, ds in PROJECT["optional-dependencies"].items() if name != "test" for d in ds)])
    imported: dict[str, str] = {}
    for path in (REPO / "elastic_harness").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "elastic_harness":
                    imported.setdefault(top, str(path.relative_to(REPO)))
    unknown = {m: where for m, where in imported.items() if m not in PROVIDED_BY}
    assert unknown == {}, "a third-party import with no declared dependency (add it to pyproject and here)"
    undeclared = {m: PROVIDED_BY[m] for m in imported if PROVIDED_BY[m] not in declared}
    assert undeclared == {}
