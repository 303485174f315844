"""The worker zygote with nothing preloaded (it starts at once): workers get exactly the
environment, arguments and streams they are given, exit codes and signals come back as
``Popen`` would report them, and everything dies with the agent that owns the zygote."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastic_harness.agent.warm import process_failure, warm_invocation
from elastic_harness.agent.zygote import Zygote
from tests.conftest import REPO
from tests.servers import wait_until

# The preloaded interpreter three tests read (``preloaded_entry``) runs once, on one worker (tests/lanes.py)
pytestmark = [pytest.mark.timeout(60), pytest.mark.xdist_group("zygote-preload")]
CHILD = "tests.zygote_child"


def test_only_interpreter_module_commands_run_warm():
    assert warm_invocation(sys.executable, ["-u", "-m", "pkg.entry", "a", "b"]) == ("pkg.entry", ["a", "b"], True)
    assert warm_invocation(sys.executable, ["-m", "pkg.entry"]) == ("pkg.entry", [], False)
    assert warm_invocation(sys.executable, ["script.py", "a"]) is None
    assert warm_invocation("/usr/bin/other-python", ["-m", "pkg"]) is None
    assert warm_invocation(sys.executable, ["-u", "-c", "print(1)"]) is None


@pytest.fixture
def zygote(monkeypatch):
    monkeypatch.chdir(REPO)  # workers run in the agent's directory: tests.* is importable
    z = Zygote(preload=())
    z.start()
    yield z
    z.stop()


def _spawn(z: Zygote, tmp_path, action: str, name: str) -> tuple[int, str]:
    out = tmp_path / f"{name}.out"
    env = {"ZYGOTE_TEST": name, "PATH": os.environ.get("PATH", "")}
    pid = z.spawn(CHILD, [action], env, stdout=str(out), stderr=str(tmp_path / f"{name}.err"),
                  unbuffered=True)
    return pid, str(out)


def _exit_of(z: Zygote, pid: int) -> int:
    wait_until(lambda: pid in z.poll(timeout=0.2), 30, f"worker {pid} to end")
    return z.exits[pid]


def test_the_agent_can_wait_for_the_zygotes_imports_before_joining(zygote):
    """``wait_ready``: True once the zygote said it is ready (an agent joins the rendezvous
    then, so a running group does not drain and then wait for these imports); a stopped
    zygote is not waited for."""
    assert zygote.wait_ready(30) and zygote.threads is not None
    z = Zygote(preload=())
    assert z.wait_ready(30) is False  # never started: lost at once, no wait


def test_a_half_written_error_file_reads_as_none(tmp_path):
    """A worker stopped while it writes its error file (its peer died, the group is being
    stopped) leaves it empty or cut short: the agent records the failure without its message
    instead of failing on it (torch's ``ProcessFailure`` raises, which ended a run with restarts
    left in the kill-worker bench)."""
    import json

    whole = tmp_path / "whole.json"
    whole.write_text(json.dumps({"message": {"message": "RuntimeError: boom",
                                             "extraInfo": {"py_callstack": "", "timestamp": "7"}}}))
    assert process_failure(1, 42, 1, str(whole)).message["message"] == "RuntimeError: boom"
    for content in ("", '{"message": {"mess'):
        cut = tmp_path / "cut.json"
        cut.write_text(content)
        failure = process_failure(1, 42, -15, str(cut))
        assert failure.exitcode == -15 and "Signal 15" in failure.message
    absent = process_failure(0, 43, -9, str(tmp_path / "absent.json"))
    assert "Signal 9" in absent.message


def test_workers_run_their_module_with_their_env_argv_and_streams(zygote, tmp_path):
    ok, ok_out = _spawn(zygote, tmp_path, "0", "first")
    bad, bad_out = _spawn(zygote, tmp_path, "3", "second")
    assert (_exit_of(zygote, ok), _exit_of(zygote, bad)) == (0, 3)
    lines = Path(ok_out).read_text().splitlines()
    assert lines[0].startswith("first ['0'] parent=") and lines[-1] == "atexit ran"
    assert Path(bad_out).read_text().startswith("second ['3']")  # not the first worker's environment


def test_signals_reach_running_workers_only(zygote, tmp_path):
    pid, _ = _spawn(zygote, tmp_path, "sleep", "sleeper")
    zygote.signal(pid, signal.SIGTERM)
    assert _exit_of(zygote, pid) == -signal.SIGTERM
    zygote.signal(pid, signal.SIGKILL)  # already reaped: not sent (the pid may be reused)


def test_the_zygote_outlives_signals_sent_to_every_process_of_the_job(zygote, tmp_path):
    """Slurm's ``scancel --signal=TERM`` signals every process of a job step: the zygote must
    stay for the workers' drain (it goes with its agent), and its workers still get the
    default dispositions (the one below dies of its SIGTERM)."""
    pid, _ = _spawn(zygote, tmp_path, "sleep", "sleeper")
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        os.kill(zygote._proc.pid, sig)
    os.kill(pid, signal.SIGTERM)
    assert _exit_of(zygote, pid) == -signal.SIGTERM
    assert not zygote.lost()
    again, _ = _spawn(zygote, tmp_path, "0", "after")
    assert _exit_of(zygote, again) == 0


AGENT = textwrap.dedent("""
    import os, sys, time
    from elastic_harness.agent.zygote import Zygote
    z = Zygote(preload=())
    z.start()
    pid = z.spawn("tests.zygote_child", ["sleep"], dict(os.environ), stdout=sys.argv[1],
                  stderr=sys.argv[1] + ".err", unbuffered=True)
    print(z._proc.pid, pid, flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_zygote_and_workers_die_with_their_agent(tmp_path):
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(tmp_path / "w.out")], cwd=REPO,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        zygote_pid, worker_pid = map(int, agent.stdout.readline().split())
        assert _alive(zygote_pid) and _alive(worker_pid)
        wait_until(lambda: os.getsid(worker_pid) == worker_pid, 30,  # as torchelastic's workers
                   "the worker to start its own session")
    finally:
        os.killpg(agent.pid, signal.SIGKILL)  # the agent's group: not the zygote's session
        agent.wait()
    wait_until(lambda: not _alive(zygote_pid) and not _alive(worker_pid), 30,
               "the zygote and its worker to die with the agent")


@pytest.fixture(scope="module")
def preloaded_entry(tmp_path_factory) -> subprocess.CompletedProcess:
    """One interpreter does what the zygote does before its first fork, the core install's
    way (no tensorboard): ``zygote.preload()`` (its thread count printed), then runs the
    worker command's module as ``__main__`` the way each fork does. The preload imports
    torch and DCP: seconds of CPU, paid once for the two tests below."""
    from elastic_harness.launch.config import worker_command

    tmp = tmp_path_factory.mktemp("preload")
    _, args = worker_command(tmp)
    module = args[args.index("-m") + 1]
    code = textwrap.dedent(f"""
        import sys
        sys.modules['tensorboard'] = None  # the core install has no tensorboard
        from elastic_harness.runtime import zygote
        print(zygote.preload(), flush=True)
        import typing
        from pathlib import Path
        from elastic_harness.spec import loader
        typing.get_type_hints = None  # resolved by the preload (spec.loader.prepare) or this fails
        print(len([loader.load_job(p) for p in sorted(Path({str(REPO / "jobs")!r}).glob("*.yaml"))]), flush=True)
        sys.exit(zygote.run_module({module!r}, [{str(tmp / "none.yaml")!r}, {str(tmp)!r}]))
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50,
                          cwd=tmp, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_warm_worker_runs_the_entry_module_without_runpys_warning(preloaded_entry):
    """The zygote imports its preload list, then each fork runs the worker command's module as
    ``__main__``: nothing on that list may be that module, or every worker's stderr starts
    with runpy's RuntimeWarning (and the module runs twice)."""
    r = preloaded_entry
    assert "does not exist" in r.stderr, r.stderr  # the entry ran (and refused the missing job)
    assert "RuntimeWarning" not in r.stderr, r.stderr


def test_the_zygote_preloads_without_the_optional_extras(preloaded_entry):
    """The core install has no tensorboard: the zygote's preload skips what an extra provides
    (it used to import torch.utils.tensorboard unconditionally and die)."""
    printed = preloaded_entry.stdout.strip().splitlines()
    assert printed and printed[0].isdigit(), preloaded_entry.stderr[-2000:]
    assert int(printed[0]) >= 1


def test_the_zygote_resolves_the_job_schema_before_its_forks_read_a_job(preloaded_entry):
    """After the preload a fork parses any shipped job without resolving a type annotation
    (the fixture removes ``typing.get_type_hints``): that work is done once, not per worker."""
    printed = preloaded_entry.stdout.strip().splitlines()
    assert len(printed) >= 2 and int(printed[1]) >= 5, preloaded_entry.stderr[-2000:]


def test_the_host_zygote_imports_tensorboard_only_for_a_job_that_writes_it():
    """``run``'s host zygote preloads before any agent can start: TensorBoard's writer (a third
    of a CPU second) only when ``metrics.tensorboard`` is on, as the agents' own zygotes do;
    the modules that wait for the run dir never."""
    from elastic_harness.runtime.zygote import AFTER_RUN_DIR, TENSORBOARD
    from elastic_harness.simcluster.cluster import host_preload

    assert TENSORBOARD not in host_preload(tensorboard=False)
    assert TENSORBOARD in host_preload(tensorboard=True)
    assert not set(AFTER_RUN_DIR) & set(host_preload(tensorboard=True))
    assert "torch" in host_preload(tensorboard=False)


def test_workers_get_fixed_malloc_thresholds_unless_the_user_chose():
    """The zygote and its workers start with fixed glibc thresholds (the dynamic ones left
    forked workers faulting ~1500 pages a step); any MALLOC_* of the user's wins."""
    from elastic_harness.launch.config import worker_malloc_environ

    env = worker_malloc_environ({"PATH": "/bin"})
    assert env == {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(128 << 20)}
    assert worker_malloc_environ({"MALLOC_ARENA_MAX": "2"}) == {}


def test_a_worker_gets_its_control_channel_through_the_zygote(zygote, tmp_path):
    """The agent's end and the worker's end of a control line (``agent.control``,
    ``runtime.control``): the worker is told to leave and to re-form, answers, and exits when
    told to; nothing but JSON crosses."""
    from elastic_harness.agent.control import Lines

    lines = Lines()
    ours, theirs = lines.open_line()
    env = {"PATH": os.environ.get("PATH", "")}
    pid = zygote.spawn("tests.control_child", [], env, stdout=str(tmp_path / "out"),
                       stderr=str(tmp_path / "err"), unbuffered=True, line=theirs)
    theirs.close()
    lines.adopt(pid, ours)

    def heard(op):
        wait_until(lambda: any(m["op"] == op for m in lines.heard.get(pid, []) + [m for _, m in lines.hear()]),
                   30, f"the worker's {op}")
        return [m for m in lines.take(pid) if m["op"] == op][-1]

    assert heard("parked")["step"] == 7
    assert lines.say(pid, "leave", reason="rank 3 died")
    assert lines.say(pid, "leave", reason="node 2 is gone", remote=True)  # another node's failure
    assert lines.say(pid, "reform", env={"RANK": "5"})
    got = heard("reformed")
    assert got["rank"] == "5" and got["pid"] == pid
    assert got["left"] == [["rank 3 died", False], ["node 2 is gone", True]]
    assert lines.say(pid, "exit")
    assert _exit_of(zygote, pid) == 0
    lines.close()


def test_a_kept_worker_has_its_next_place_before_the_groups_context_is_made_and_once(zygote, tmp_path):
    """In place, a kept worker's ``reform`` order goes out as soon as torch made the next
    group's variables (``Keep.hand_over``), before torch sets up that group's log files (the
    context's construction); the context then adopts it without a second order."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    from elastic_harness.agent.warm import Keep, WarmContext

    keep = Keep()
    ours, theirs = keep.lines.open_line()
    pid = zygote.spawn("tests.control_child", [], {"PATH": os.environ.get("PATH", "")},
                       stdout=str(tmp_path / "out"), stderr=str(tmp_path / "err"), unbuffered=True, line=theirs)
    theirs.close()
    keep.lines.adopt(pid, ours)
    said = []

    def heard(op):
        wait_until(lambda: said.extend(m for _, m in keep.lines.hear()) or any(m["op"] == op for m in said),
                   30, f"the worker's {op}")

    heard("parked")
    keep.kept = {0: pid}
    envs = {0: {"RANK": "5", "TORCHELASTIC_RUN_ID": "t", "TORCHELASTIC_RESTART_COUNT": "1"}}
    keep.hand_over(envs, zygote.exits)
    heard("reformed")  # before any context of the next group exists
    context = WarmContext("w", zygote, {0: ("-u", "-m", "tests.control_child")}, envs,
                          DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), keep=keep)
    assert context._adopt(0) and context.adopted == {0: pid} and keep.kept == {}
    assert keep.lines.say(pid, "exit")
    assert _exit_of(zygote, pid) == 0
    said.extend(m for _, m in keep.lines.hear())
    assert [m["rank"] for m in said if m["op"] == "reformed"] == ["5"], "one order, not two"
    keep.lines.close()


def test_a_worker_without_a_line_has_no_control_channel(zygote, tmp_path):
    pid = zygote.spawn("tests.control_child", [], {"PATH": os.environ.get("PATH", "")},
                       stdout=str(tmp_path / "out"), stderr=str(tmp_path / "err"), unbuffered=True)
    assert _exit_of(zygote, pid) == 3


# The host zygote of a local run (``simcluster.cluster``): agents forked with a worker
# zygote of their own. Nothing preloaded here either; the agent is ``tests.agent_child``.


def _stat(pid: int) -> list[str]:
    """State and parent of ``pid`` (``/proc/PID/stat``), or [] once it is reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
    except FileNotFoundError:
        return []


def _ppid(pid: int) -> int:
    return int(_stat(pid)[1])


def _dead(pid: int) -> bool:
    return _stat(pid)[:1] in ([], ["Z"])


def test_an_agent_forked_by_the_host_zygote_adopts_the_worker_zygote_forked_with_it(zygote, tmp_path):
    """``spawn_agent``: the agent finds its own worker zygote (its child, not a process it
    had to start), the name that handed it over is gone from its environment (workers must
    not inherit it), workers fork from it and report their exit codes, and the agent's exit
    code comes back through the host zygote. A second agent appends to the same log."""
    log = tmp_path / "agent.log"
    env = {"PATH": os.environ.get("PATH", "")}
    first = zygote.spawn_agent("tests.agent_child", ["run", str(tmp_path / "w1")], env, str(log))
    assert _exit_of(zygote, first) == 7
    second = zygote.spawn_agent("tests.agent_child", ["run", str(tmp_path / "w2")], env, str(log))
    assert _exit_of(zygote, second) == 7
    lines = log.read_text().splitlines()
    agents = [line.split() for line in lines if line.startswith("agent ")]
    assert [int(a[1]) for a in agents] == [first, second], lines  # appended, not truncated
    for a in agents:
        assert a[3] != "None" and a[5] == "None", lines  # adopted; the variable taken out
    assert [line for line in lines if line.startswith("worker ")][0].endswith("exit 3"), lines
    assert lines.count("zygote stopped True") == 2, lines
    worker_out = (tmp_path / "w1").read_text()
    assert worker_out.startswith("w ['3']") and f"parent={agents[0][3]}" in worker_out


def test_an_agent_and_its_zygote_die_with_the_host_zygote(zygote, tmp_path):
    """The chain of parent-death signals: the host zygote killed outright (a ``run`` killed
    with it), its agent goes, and the agent's worker zygote with it; the agent's exit reads
    as a kill."""
    from elastic_harness.simcluster.cluster import Hosted

    log = tmp_path / "agent.log"
    agent = zygote.spawn_agent("tests.agent_child", ["sleep"], {"PATH": os.environ.get("PATH", "")}, str(log))
    wait_until(lambda: log.exists() and "zygote" in log.read_text(), 30, "the agent to adopt its zygote")
    worker_zygote = int(log.read_text().split()[3])
    assert _ppid(worker_zygote) == agent and _ppid(agent) == zygote.pid
    hosted = Hosted(zygote, agent)
    assert hosted.poll() is None
    os.kill(zygote.pid, signal.SIGKILL)
    wait_until(lambda: _dead(agent) and _dead(worker_zygote), 30, "the agent and its zygote to die with the host zygote")
    assert hosted.poll() == -signal.SIGKILL and hosted.wait(timeout=1) == -signal.SIGKILL


def test_the_zygotes_flags_name_its_modules():
    from elastic_harness.runtime.zygote import PRELOAD, parse_modules

    assert parse_modules([]) == PRELOAD
    assert parse_modules(["--preload", ""]) == ()
    assert parse_modules(["--preload", "a,b", "--also", "c"]) == ("a", "b", "c")
    assert parse_modules(["--also", "x"]) == (*PRELOAD, "x")
