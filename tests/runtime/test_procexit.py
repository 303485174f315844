"""``procexit``: a process ends without teardown, yet its exit callbacks run, less torch's
teardown-only finalizers (``torch.library``'s operator unregistration)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

CHILD = textwrap.dedent("""
    import atexit, sys, tempfile, weakref
    import torch
    from elastic_harness import procexit

    class Holder:
        pass

    out = sys.argv[1]
    lib = torch.library.Library("eh_procexit_test", "DEF")
    lib.define("noop(Tensor x) -> Tensor")
    holder = Holder()
    weakref.finalize(holder, lambda: open(out + ".finalizer", "w").write("ran"))
    atexit.register(lambda: open(out + ".atexit", "w").write("ran"))
    def torch_finalizers():
        return sum(1 for f in list(weakref.finalize._registry)
                   if f.peek() and getattr(f.peek()[1], "__module__", None) == "torch.library")
    before = torch_finalizers()
    dropped = procexit.drop_teardown_finalizers()
    open(out + ".counts", "w").write(f"{before} {dropped} {torch_finalizers()}")
    procexit.exit_without_teardown(3)
""")


def test_exit_runs_callbacks_but_not_torch_library_teardown(tmp_path):
    out = tmp_path / "child"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(out)], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 3, proc.stderr
    before, dropped, after = map(int, (tmp_path / "child.counts").read_text().split())
    assert before >= 1 and dropped == before and after == 0  # ours included (eh_procexit_test)
    assert (tmp_path / "child.finalizer").read_text() == "ran"  # a finalizer of someone else's runs
    assert (tmp_path / "child.atexit").read_text() == "ran"  # and so does every atexit callback
