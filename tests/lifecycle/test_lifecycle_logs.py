"""``elastic-harness logs`` on a run directory laid out as agents and torchelastic lay it out
(two submissions appended to the same agent log, per-attempt worker files), written here.
``test_e2e_lifecycle.py`` reads the logs of real runs."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import pytest

from elastic_harness.lifecycle import logsource
from elastic_harness.lifecycle.api import LogQuery
from elastic_harness.lifecycle.logs import LogReader

pytestmark = pytest.mark.timeout(60)
T0 = time.mktime(time.strptime("2026-01-01 11:00:00", "%Y-%m-%d %H:%M:%S"))


def write(path: Path, *lines: str, mtime: float | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.writelines(line + "\n" for line in lines)
    if mtime is not None:
        os.utime(path, (mtime, mtime))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    logs = tmp_path / "logs"
    w0, w1 = logs / "J_abc", logs / "J_def"
    write(logs / "agent-0.log", "a line from before agents had headers",
          logsource.agent_header("0", "other", 1, T0 - 3600), "other job's line",
          logsource.agent_header("0", "J", 2, T0), logsource.worker_dir_line("0", "J", str(w0)),
          "I0101 11:00:05.000000 2 api.py:280] log directory set to: somewhere",
          "2026-01-01 11:00:30,000 elastic_harness INFO agent 0 later", "  an untimed continuation")
    write(logs / "agent-1.log", logsource.agent_header("1", "J", 3, T0), logsource.worker_dir_line("1", "J", str(w1)))
    write(w0 / "attempt_0/0/stdout.log", "r0 says hi", mtime=T0 + 10)
    write(w0 / "attempt_0/1/stderr.log", "r1 warns", mtime=T0 + 10)
    write(w0 / "attempt_1/0/stdout.log", "r0 again", mtime=T0 + 40)
    write(w1 / "attempt_0/0/stdout.log", "r2 says hi", mtime=T0 + 10)
    write(logs / "supervisor-J.log", "run dir: here")
    workers = [("0", 0, 0, 0), ("0", 0, 1, 1), ("1", 0, 0, 2), ("0", 1, 0, 0), ("0", 1, 1, 1), ("1", 1, 0, 2)]
    write(tmp_path / "events.jsonl", *(json.dumps({"t": T0, "event": "worker", "pid": 9, "node": n, "restart": r,
                                                  "local_rank": lr, "rank": g}) for n, r, lr, g in workers))
    return tmp_path


def dump(run_dir: Path, **query) -> list[str]:
    out = io.StringIO()
    LogReader(run_dir, "J", LogQuery(**query), extra=[("supervisor-J.log", "supervisor")]).dump(out)
    return out.getvalue().splitlines()


def test_a_jobs_logs_merged_and_prefixed(run_dir):
    lines = dump(run_dir)
    assert lines[0] == "[supervisor] run dir: here"
    assert not any("other job" in line or "from before" in line for line in lines), "only this job's sections"
    assert "[node 0 agent] 2026-01-01 11:00:30,000 elastic_harness INFO agent 0 later" in lines
    assert lines[-4:] == ["[node 0 rank 0] r0 says hi", "[node 0 rank 0, restart 1] r0 again",
                          "[node 0 rank 1 stderr] r1 warns", "[node 1 rank 2] r2 says hi"]


def test_one_rank_one_node_and_since(run_dir):
    assert dump(run_dir, rank=0) == ["[node 0 rank 0] r0 says hi", "[node 0 rank 0, restart 1] r0 again"]
    node1 = dump(run_dir, node="1")
    assert node1[-1] == "[node 1 rank 2] r2 says hi" and all(line.startswith("[node 1 ") for line in node1)
    late = dump(run_dir, since=T0 + 20)
    assert "[node 0 agent] 2026-01-01 11:00:30,000 elastic_harness INFO agent 0 later" in late
    assert "[node 0 agent]   an untimed continuation" in late, "an untimed line goes with the line before"
    assert not any("log directory set to" in line for line in late), "torch's own timed lines are filtered too"
    assert [line for line in late if "rank" in line] == ["[node 0 rank 0, restart 1] r0 again"]


def test_follow_prints_new_lines_and_new_restarts(run_dir):
    reader = LogReader(run_dir, "J", LogQuery(follow=True))
    reader.dump(io.StringIO())
    write(run_dir / "logs/J_abc/attempt_0/0/stdout.log", "r0 more")
    write(run_dir / "logs/J_def/attempt_1/0/stdout.log", "r2 after a restart")
    out = io.StringIO()
    reader.follow(out, active=lambda: False, check_s=0.0)
    assert sorted(out.getvalue().splitlines()) == ["[node 0 rank 0] r0 more", "[node 1 rank 2, restart 1] r2 after a restart"]


def test_torch_info_and_cpp_traces_are_hidden_unless_all(run_dir):
    """What is shown leaves out torch's INFO lines and folds C++ stack traces into one line;
    ``--all`` (``LogQuery(all=True)``) shows every line, and the files keep them all."""
    w0 = run_dir / "logs" / "J_abc"
    trace = ["RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer",
             "Exception raised from recvAsync at gloo/pair.cc:534 (most recent call first):",
             "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7f in libc10.so)",
             "frame #1: <unknown function> + 0x5b3 (0x7f in libtorch_cpu.so)",
             "[rank1]:I0101 11:00:07.000000 9 torch/distributed/x.py:1] a rank's torch INFO line",
             "[rank1]:[W0101 11:00:08.000000 9 ProcessGroupGloo.cpp:1] a torch warning stays"]
    write(w0 / "attempt_0/1/stderr.log", *trace)
    shown = dump(run_dir)
    assert not any("log directory set to" in line or "torch INFO line" in line for line in shown)
    assert "[node 0 rank 1 stderr] " + trace[0] in shown and not any("frame #" in line for line in shown)
    assert "[node 0 rank 1 stderr]   [C++ stack trace, 3 lines: elastic-harness logs --all shows it]" in shown
    assert any("a torch warning stays" in line for line in shown)
    everything = dump(run_dir, all=True)
    assert all(f"[node 0 rank 1 stderr] {line}" in everything for line in trace)
    assert any("log directory set to" in line for line in everything)


def test_quiet_filter_fed_line_by_line_folds_a_trace_once():
    """kubectl's lines arrive one by one, prefixed with their pod: one fold per trace."""
    quiet = logsource.Quiet()
    pod = "[pod/j-worker-0/pytorch] "
    lines = [pod + "RuntimeError: boom", pod + "frame #0: a", pod + "frame #1: b",
             pod + "I0101 11:00:07.000000 9 x.py:1] info", pod + "next"]
    shown = [kept for line in lines for kept in quiet.feed([line], end=False)] + quiet.feed([])
    assert shown == [pod + "RuntimeError: boom",
                     "  [C++ stack trace, 2 lines: elastic-harness logs --all shows it]", pod + "next"]
