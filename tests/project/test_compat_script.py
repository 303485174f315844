"""``.ci/compat VERSION``: a version that is not a release is one line; one pip cannot install
is one line too, and leaves no half-built venv behind (it showed pip's "conflicting
dependencies" and kept ``.venv-torch-9.9.9``; ``2.11.0`` downloaded 5.6 GB without a word)."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import REPO

COMPAT = REPO / ".ci" / "compat"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, words", [(["abc"], "'abc' is not a torch release"),
                                         (["2.14.1", "--bogus"], "'--bogus' is not a mode")])
def test_a_version_or_mode_that_is_not_one_is_one_line(args, words):
    r = subprocess.run(["bash", str(COMPAT), *args], capture_output=True, text=True, timeout=50, cwd=REPO)
    assert (r.returncode, r.stdout) == (2, "") and r.stderr.startswith(f"error: {words}"), r.stderr
    assert not (REPO / f".venv-torch-{args[0]}").exists()


@pytest.mark.e2e  # builds a venv (about a minute on 2 cores), then pip looks torch 9.9.9 up
@pytest.mark.timeout(300)
def test_a_release_pip_cannot_install_is_said_and_its_venv_removed():
    venv = REPO / ".venv-torch-9.9.9"
    assert not venv.exists()
    r = subprocess.run(["bash", str(COMPAT), "9.9.9"], capture_output=True, text=True, timeout=280, cwd=REPO)
    assert r.returncode == 2, r.stderr
    assert "compat: building .venv-torch-9.9.9: torch==9.9.9 from the package index" in r.stderr
    assert "several GB" in r.stderr, "what it will fetch is said before it fetches"
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "pip could not install torch==9.9.9" in errors[0]
    assert "compat: .venv-torch-9.9.9 removed (not built)" in r.stderr and not venv.exists()
