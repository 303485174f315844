"""``elastic-harness run JOB.yaml``: train on this machine with N simulated nodes."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic_harness import exitcodes, jobkey, runfiles
from elastic_harness.chaos.inject import ChaosController
from elastic_harness.chaos.vocabulary import check_netns, check_targets
from elastic_harness.checkpoint.lock import Holder
from elastic_harness.commands.jobargs import add_job_arguments, load_with_flags
from elastic_harness.commands.report import check_reference, compare_with
from elastic_harness.commands.support import resumepoint, spares
from elastic_harness.commands.support.progress import Progress
from elastic_harness.commands.support.scriptfiles import check_compiles
from elastic_harness.deps import require_spec_extras
from elastic_harness.errors import ClusterError, HarnessError, Preempted
from elastic_harness.events import EventLog, EventTail, read_events
from elastic_harness.launch.config import new_rdzv_id
from elastic_harness.launch.policy import finish_bound_s
from elastic_harness.launch.scratch import INDUCTOR_CACHE_VAR
from elastic_harness.records.rundir import check_paths, prepare
from elastic_harness.records.runstate import RunState
from elastic_harness.records.summary import summarize
from elastic_harness.simcluster.cluster import (
    AgentArgs,
    Hosts,
    LocalCluster,
    free_port,
    start_host_zygote,
)
from elastic_harness.simcluster.netns import NetnsTopology
from elastic_harness.torchcompat.host import check_and_warn


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="train a job on this machine (CPU/gloo, or GPUs when present)",
                       description="Train a job on this machine: `run JOB.yaml [flags]`, or, like torchrun, "
                                   "`run [flags] train.py [script args]` for a script: its job is the YAML "
                                   "beside it that names it, else the spec's defaults (plus --set); "
                                   "everything after the script is its own.")
    add_job_arguments(p)  # shared with submit (commands.jobargs)
    p.add_argument("--nodes", type=int, help="simulated nodes (agents) to start (default nodes.min)")
    p.add_argument("--job-id", help="id of this submission, also its rendezvous id (default: "
                                    "rendezvous.id, else a fresh one; `submit` passes its own)")
    p.set_defaults(func=cmd_run, fast_exit=True)


def cmd_run(args: argparse.Namespace) -> int:
    spec = load_with_flags(args)  # --chaos faults join the spec: workers read them from the resolved spec
    args.netns = args.netns or args.separate_hosts
    nodes = spec.nodes.min if args.nodes is None else args.nodes  # --nodes 0 is refused, not a default
    if not spec.nodes.min <= nodes <= spec.nodes.max:
        raise HarnessError(f"--nodes {nodes} is outside nodes.min..max ({spec.nodes.min}..{spec.nodes.max})",
                           "pick a count in range or change nodes in the job")
    spares.check(spec.nodes.spares, nodes, spec.nodes.max)
    check_faults(spec, nodes, args.netns)
    check_paths(Path(args.run_dir or Path("runs") / spec.name), spec)  # in well under a second
    if args.verify:  # the reference is read before anything trains, not after
        check_reference(Path(args.verify))
    require_spec_extras(spec)  # a missing extra is named before torch is imported (preflight)
    # The agents' zygote imports torch while this process checks the job (``simcluster``).
    zygote = None if args.netns else start_host_zygote(tensorboard=spec.metrics.tensorboard)
    try:
        return _checked(spec, args, nodes, zygote)
    finally:
        if zygote is not None:  # stopped by the cluster after a run; else refused, done: unused
            zygote.stop(grace_s=0)


def _checked(spec, args: argparse.Namespace, nodes: int, zygote) -> int:
    from_epochs = bool(spec.train.epochs)
    check_and_warn(spec)  # the installed torch can run the harness (torchcompat.host)
    spec = preflight(spec, Path(args.job))
    if from_epochs:  # train.epochs became train.steps: each fault's step must fall inside
        check_faults(spec, nodes, args.netns, warn=False)
    run_dir = Path(args.run_dir or Path("runs") / spec.name)
    done = "" if args.fresh else resumepoint.check(spec, run_dir)  # finished: nothing to start
    if not done:
        return _run(spec, args, run_dir, nodes, zygote)  # --verify: part of its outcome (``_finish``)
    print(done)
    problem = compare_with(run_dir, args.verify) if args.verify else None
    if problem is not None:
        raise problem
    return 0


def _run(spec, args: argparse.Namespace, run_dir: Path, nodes: int, zygote=None) -> int:
    rdzv_id = args.job_id or spec.rendezvous.id or new_rdzv_id(spec.name)
    # The agents join this submission's locks: by its token, so that another submission that
    # pinned the same rendezvous id (rendezvous.id, --job-id) is refused, not joined.
    holder = Holder.this_process(spec.name, rdzv_id, submission=uuid.uuid4().hex)
    # The key the agents will use (``jobkey.key_path``), checked here, before any launch.
    given = os.environ.get(jobkey.KEY_FILE_VAR)
    with prepare(run_dir, spec, fresh=args.fresh, holder=holder, key_file=Path(given) if given else None) as claim:
        register_run(spec, claim.path, Path(args.job), rdzv_id)
        try:
            hosts = Hosts(netns=args.netns, separate=getattr(args, "separate_hosts", False), zygote=zygote)
            return launch_local(spec, claim.path, nodes, hosts, rdzv_id=rdzv_id, submission=holder.submission,
                                verify=args.verify)
        finally:
            record_outcome(rdzv_id)


def register_run(spec, run_dir: Path, job_file: Path, job_id: str) -> None:
    """Put this job in the registry, so ``status`` and ``list`` see it (``lifecycle``). A
    detached job's ``submit`` already did (this process is its supervisor)."""
    from elastic_harness.lifecycle import registry
    from elastic_harness.lifecycle.local import Supervisor, supervisor_record

    root = registry.state_dir()
    known = registry.load(job_id, root)
    if known is None or Supervisor.of(known).pid != os.getpid():
        try:
            registry.save(supervisor_record(spec, run_dir, job_file, job_id, os.getpid(), via="run"), root)
        except HarnessError as e:  # training does not depend on the registry: say so and go on
            print(f"warning: {e.message}; `status` and `list` will not show this job", file=sys.stderr)


def record_outcome(job_id: str) -> None:
    """Keep how this job ended in its record (``schedulers.status_of``), so that ``status``
    still says it once the run dir is removed."""
    from elastic_harness.lifecycle import registry
    from elastic_harness.lifecycle.schedulers import status_of

    root = registry.state_dir()
    record = registry.load(job_id, root)
    if record is not None:
        status_of(record, root)


def check_faults(spec, nodes: int, netns: bool, warn: bool = True) -> None:
    """Refuse faults this run cannot carry out, before any agent starts (and say which
    hit a spare, once: ``warn``)."""
    check_netns(spec.chaos, netns)
    adds = sum(1 for f in spec.chaos if f.kind == "add-node")
    check_targets(spec.chaos, ranks=spec.nodes.max * spec.nproc_per_node, nodes=nodes + spec.nodes.spares + adds,
                  steps=0 if spec.train.epochs else spec.train.steps)  # epochs: checked once resolved
    if spec.train.epochs or not warn:
        return
    for line in spares.faults_on_spares(spec.chaos, nodes, spec.nodes.spares):
        print(f"warning: {line}", file=sys.stderr)


def preflight(spec, job_path: Path, note=print):
    """Fail before any agent starts: import and build the task, or find the script and
    compile it with the modules beside it that it imports (``scriptfiles``).

    A script path is made absolute (relative to the working directory, else to the job
    file's directory) so agents and workers find it wherever they run.
    """
    if spec.script.path:
        if spec.train.epochs:
            raise HarnessError("train.epochs needs the dataset's size before workers start, and a "
                               "script's dataset is built inside the script",
                               "set train.steps = ceil(epochs x dataset size / global_batch_size) "
                               "(docs/script-api.md, Epochs)")
        script = resolve_script(spec.script.path, job_path)
        check_compiles(script)  # a syntax error is one line here, not a crash loop in every worker
        return dataclasses.replace(spec, script=dataclasses.replace(spec.script, path=str(script)))
    from elastic_harness.tasks import load_task

    with throwaway_inductor_cache():  # importing the task may import torch's compiler
        task = load_task(spec.task.target, spec.task.args)
        model = check_model_builds(task, spec.task.target)
        check_layout(task, model, spec)
        return resolve_epochs(spec, task, note) if spec.train.epochs else spec


def resolve_epochs(spec, task, note=print):
    """``train.epochs`` as ``train.steps`` (``data.epochs``): the task's dataset is built once
    here for its size; the spec workers read then says ``steps: N, epochs: 0``."""
    from elastic_harness.data.adapters import source_of
    from elastic_harness.data.epochs import describe, samples_per_epoch, steps_for_epochs

    size = samples_per_epoch(source_of(task.dataset()))
    t = spec.train
    steps = steps_for_epochs(t.epochs, size, t.global_batch_size)
    note(describe(t.epochs, size, t.global_batch_size))
    return dataclasses.replace(spec, train=dataclasses.replace(t, steps=steps, epochs=0))


def check_layout(task, model, spec) -> None:
    """A mesh layout with tensor parallelism: the task has a plan, and the plan fits the model
    (``check_parallelize``: module names, sizes the tensor degree divides). One line now, not a
    crash loop in every worker; no checkpoint is touched."""
    tensor = spec.parallelism["tensor"] if isinstance(spec.parallelism, dict) else 1
    if tensor == 1:
        return
    from elastic_harness.errors import TaskError

    if not callable(getattr(task, "parallelize", None)):
        raise TaskError(f"parallelism.tensor is {tensor} but task.target '{spec.task.target}' has no "
                        "parallelize(model, mesh)", "add a tensor-parallel plan to the task, or set "
                        "parallelism.tensor: 1")
    check = getattr(task, "check_parallelize", None)
    if callable(check):
        check(model, tensor)


@contextlib.contextmanager
def throwaway_inductor_cache():
    """torch's compiler makes its cache directory under the temp dir when imported; the host
    has no run dir yet here, so point it at a temp dir removed afterwards (a run leaves
    nothing in /tmp). A ``TORCHINDUCTOR_CACHE_DIR`` the user set is left alone."""
    if os.environ.get(INDUCTOR_CACHE_VAR):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="elastic-harness-build-") as tmp:
        os.environ[INDUCTOR_CACHE_VAR] = tmp
        try:
            yield
        finally:
            os.environ.pop(INDUCTOR_CACHE_VAR, None)


def check_model_builds(task, target: str):
    """Build the task's model once here, before any worker: a ``build_model`` that raises is
    one line now, not one failure per rank and a crash loop. Built on the meta device first
    (no memory, no initialisation cost); a model that cannot be built there is built for
    real, and only a failure there too is the task's."""
    import torch

    from elastic_harness.errors import TaskError
    from elastic_harness.runtime.failures import describe

    try:
        with torch.device("meta"):
            model = task.build_model()
    except Exception:  # noqa: BLE001 - some models cannot live on meta: try for real
        try:
            model = task.build_model()
        except Exception as e:  # noqa: BLE001 - whatever the user's code raises
            d = describe(e)
            raise TaskError(f"task.target '{target}': build_model() raised {d['message']} (at {d['where']})",
                            "fix build_model() at the line named; nothing was started") from None
    if not isinstance(model, torch.nn.Module):
        raise TaskError(f"task.target '{target}': build_model() returned {type(model).__name__}, "
                        "not a torch.nn.Module", "return the model (an nn.Module) from build_model()")
    return model


def resolve_script(path: str, job_path: Path) -> Path:
    for candidate in (Path(path), job_path.parent / path):
        if candidate.is_file():
            return candidate.resolve()
    raise HarnessError(f"script.path '{path}' does not exist (looked in the working directory "
                       f"and next to {job_path})", "fix script.path in the job, or run from the "
                       "directory it is relative to")


@dataclasses.dataclass(frozen=True)
class LocalRun:
    """What one run on this machine is given (``launch_local``): the job, its run dir, how
    many nodes on which hosts, its rendezvous id, the submission whose locks the agents join
    ("": none), and a reference run's directory to compare the final model with (None: none)."""

    spec: Any
    run_dir: Path
    nodes: int
    hosts: Hosts
    rdzv_id: str
    submission: str = ""
    verify: str | None = None


def launch_local(spec, run_dir: Path, nodes: int, hosts: Hosts, rdzv_id: str = "", submission: str = "",
                 verify: str | None = None) -> int:
    """Train on this machine, with the job's faults (``spec.chaos``), on ``hosts``;
    ``verify``: a reference run's directory, compared with the final model before the exit is
    recorded (a model that differs is the run's failure)."""
    events = EventLog(run_dir / runfiles.EVENTS)
    chaos = ChaosController(spec.chaos, events, run_dir)
    run = LocalRun(spec, run_dir, nodes, hosts, rdzv_id or spec.rendezvous.id or new_rdzv_id(spec.name),
                   submission, verify)
    topology = NetnsTopology() if hosts.netns else None
    try:
        endpoint = _endpoint(spec, topology)
        return _launch(run, events, chaos, endpoint, topology)
    finally:
        if topology is not None:
            topology.teardown()


def _endpoint(spec, topology: NetnsTopology | None) -> str:
    """Where the rendezvous lives. With namespaces, loopback means this machine's bridge
    address (a namespace's own loopback is its own), and c10d's store lives in node 0."""
    endpoint = spec.rendezvous.endpoint
    if topology is None:
        return endpoint or f"127.0.0.1:{free_port()}"
    topology.setup()
    host0 = topology.add_host(0)
    if not endpoint:
        return f"{host0.addr}:{free_port()}"
    host, _, port = endpoint.rpartition(":")
    return f"{topology.gateway}:{port}" if host in ("127.0.0.1", "localhost") else endpoint


def _launch(run: LocalRun, events: EventLog, chaos, endpoint: str, topology: NetnsTopology | None) -> int:
    spec, run_dir, nodes, hosts = run.spec, run.run_dir, run.nodes, run.hosts
    tail = EventTail(run_dir / runfiles.EVENTS)
    events.emit("start", who="host", nodes=nodes, nproc_per_node=spec.nproc_per_node, run_id=run.rdzv_id,
                run_dir=str(run_dir), netns=topology is not None, separate_hosts=hosts.separate)
    print(f"run dir: {run_dir}  (logs in {run_dir / 'logs'})")
    agents = AgentArgs(run_dir / runfiles.RESOLVED_SPEC, run_dir, run.rdzv_id, endpoint,
                       backend=spec.rendezvous.backend,
                       extra=("--submission", run.submission) if run.submission else ())
    cluster = LocalCluster(agents, nodes, netns=topology, separate_hosts=hosts.separate, zygote=hosts.zygote)
    progress = Progress(spec.train.steps, step_timeout=spec.timeouts.step)
    fatal, lingering = None, ""
    stop = StopSignal()
    idle = spares.Spares(spec.nodes.spares, nodes)
    try:
        cluster.start()
        fatal, lingering = _supervise(cluster, tail, progress, chaos, spec, stop, idle, events)
        unjoined = [i for i in chaos.unjoined(cluster.running()) if not idle.is_spare(i)] \
            if progress.state.finished else []
    finally:
        chaos.thaw(cluster)
        cluster.stop(grace_s=spec.timeouts.shutdown_grace + 10)
        stop.restore()
        for e in tail.read():  # what the drain wrote while the nodes stopped
            progress.update(e)
            chaos.observe(e, cluster)
        progress.close()
    _what_did_not_happen(chaos, unjoined, progress.state.step)
    return _finish(run, events, cluster, fatal, stop.signum, progress.state, lingering)


def _what_did_not_happen(chaos: ChaosController, unjoined: list[int], step: int) -> None:
    """Say which faults the run was given but never fired, and which started nodes never
    joined before it finished: a run that ends quietly without them misleads."""
    missed = chaos.unfired()
    if missed:
        from elastic_harness.chaos.vocabulary import fault_text

        print(f"warning: {len(missed)} scheduled fault(s) did not fire: "
              f"{', '.join(fault_text(f) for f in missed)} (the run ended after step {step})", file=sys.stderr)
    for index in unjoined:
        print(f"note: node {index} had not joined the job when it finished (it was stopped)", file=sys.stderr)


class StopSignal:
    """SIGTERM, SIGINT (Ctrl-C) and SIGHUP (the terminal closed) ask ``run`` to stop: the
    supervision loop ends, ``cluster.stop`` sends SIGTERM to the agents, whose workers finish
    their step and save, and the exit is recorded. A second signal while that drain runs
    raises ``KeyboardInterrupt``: the impatient get a kill (agents and workers die with this
    process, by their parent-death signal)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# How often the host looks at the log and its agents: the latency of a time-keyed fault and
# of noticing that the agents exited (a stopped job's exit waits for it). Each look reads
# only the bytes appended since the last one.
POLL_S = 0.05


def _supervise(cluster: LocalCluster, tail: EventTail, progress: Progress, chaos, spec,
               stop: StopSignal, idle: spares.Spares | None = None, events: EventLog | None = None
               ) -> tuple[str | None, str]:
    """Follow events until every agent exits; returns a fatal message if one was logged, and
    what was cut short: after the last step, every node of the last worker group gets
    ``policy.finish_bound_s`` to exit (a rank may go on working after ``run.close()``); those
    still running then are named here. Nodes outside that group (say, a frozen one the job
    went on without) are left to ``cluster.stop`` once the group's nodes are done.

    Agents end by themselves: on success, after too few nodes for rendezvous.join_timeout,
    when isolated from the rendezvous, or when their restarts run out. A stop signal ends it
    at once.
    """
    finished_at = None
    bound = finish_bound_s(spec.timeouts.process_group, spec.timeouts.shutdown_grace)
    where: dict[int, str] = {}  # rank -> node of its newest worker; key -1: the newest world size
    while stop.signum is None:
        for e in tail.read():
            progress.update(e)
            _look(e, cluster, chaos, idle, events)
            if e["event"] == "failure" and e.get("fatal"):
                return e["message"], ""
            if e["event"] == "finish":
                finished_at = time.monotonic()
            if e["event"] == "worker":
                where[int(e.get("rank", -1))], where[-1] = str(e.get("node", "")), str(e.get("world_size", 0))
        chaos.tick(cluster)
        if idle is not None:
            idle.watch(cluster.poll(), chaos.joined)
        if all(code is not None for code in cluster.poll().values()):
            for e in tail.read():
                progress.update(e)
                chaos.observe(e, cluster)
            return None, ""
        lingering = _after_finish(cluster, chaos, where, finished_at, bound) if finished_at else None
        if lingering is not None:
            return None, lingering
        time.sleep(POLL_S)
    return None, ""


def _look(e: dict, cluster: LocalCluster, chaos, idle: spares.Spares | None, events: EventLog | None) -> None:
    """What the host's helpers learn from one event: the chaos controller, the spares."""
    chaos.observe(e, cluster)
    if idle is not None and events is not None:
        idle.observe(e, cluster, events)


def _after_finish(cluster: LocalCluster, chaos, where: dict[int, str], finished_at: float, bound: float) -> str | None:
    """After the last step: "" once nothing of the last group runs (or only nodes that never
    joined), the nodes cut short once ``bound`` passed, else None (wait on)."""
    members = group_members(where)
    running = [i for i in cluster.running() if not members or str(i) in members]
    if not running or len(chaos.unjoined(cluster.running())) == len(cluster.running()):
        return ""
    if time.monotonic() - finished_at > bound:
        return cut_short(running, members, bound)
    return None


def group_members(where: dict[int, str]) -> dict[str, set[int]]:
    """Pure: node -> ranks of the newest worker group, from each rank's newest ``worker``
    event (``where[rank]`` its node, ``where[-1]`` the newest world size): every rank of a
    group announces itself, so ranks below the newest world size were all in it."""
    members: dict[str, set[int]] = {}
    for rank in range(int(where.get(-1, 0) or 0)):
        if rank in where:
            members.setdefault(where[rank], set()).add(rank)
    return members


def cut_short(running: Sequence[int], ranks: dict[str, set[int]], bound_s: float) -> str:
    """Pure: one line naming the nodes (and their ranks) still running ``bound_s`` after the
    last step ("" when none)."""
    if not running:
        return ""
    named = ", ".join(f"node {i}" + (f" (ranks {', '.join(map(str, sorted(ranks[str(i)])))})"
                                     if ranks.get(str(i)) else "") for i in running)
    return (f"the last step finished, but {named} still ran {bound_s:.0f}s later (timeouts.process_group + "
            "timeouts.shutdown_grace) and were stopped: what they did after the last step (run.close() "
            "and after) was cut short")


def _finish(run: LocalRun, events: EventLog, cluster: LocalCluster, fatal: str | None,
            stopped_by: int | None, state: RunState, lingering: str = "") -> int:
    """Decide the outcome (``outcome``) from ``state`` (this invocation's events, folded as
    they were read; ``run.verify``: a finished run's model is compared with that run's,
    ``compare_with``), log the host's ``exit``, then write ``summary.json`` from the whole log
    (exit included, so its goodput is the one ``report`` prints).

    Re-reading and folding the log before the ``exit`` event took ~1 s per 10,000 events
    (a 5-minute run): time every stopped or finished job spent after its agents were gone."""
    run_dir, verify = run.run_dir, run.verify
    codes = {i: n.returncode() for i, n in cluster.nodes.items()}
    permanent = [m for c, m in state.agent_exits if c == exitcodes.PERMANENT]
    code, message = outcome(Happened(finished=state.finished, fatal=fatal, permanent=(permanent or [""])[-1],
                                     stopped_by=stopped_by, codes=codes, drained_at=state.drained_at,
                                     agent_exits=state.agent_exits, superseded=state.superseded,
                                     cut_short=lingering, sessions=state.generations))
    unverified = compare_with(run_dir, verify) if code == exitcodes.OK and verify else None
    if unverified is not None:  # recorded as the run's exit: `status` of a submission says it too
        code, message = unverified.exit_code, unverified.message
    events.emit("exit", who="host", code=code, message=message)
    summary = summarize(read_events(run_dir / runfiles.EVENTS))
    summary["agent_exit_codes"] = codes
    try:
        (run_dir / runfiles.SUMMARY).write_text(json.dumps(summary, indent=2))
    except OSError as e:  # a full disk: the outcome is still said, and recorded where it could be
        print(f"warning: cannot write {run_dir / runfiles.SUMMARY} ({e.strerror or e})", file=sys.stderr)
    if unverified is not None:
        raise unverified
    if code != exitcodes.OK:
        raise _error(code, message, run_dir, from_agent=bool(permanent) and not fatal)
    if message:  # a plain script's success (``outcome``)
        print(f"finished: {message}")
        return 0
    print(finished_line(summary))
    print(f"model digest {summary['model_digest']}")
    return 0


def finished_line(summary: dict) -> str:
    """Pure: the line a finished run ends with; a run that trained no step says so (no
    ``loss None -> None``)."""
    if summary.get("first_loss") is None or summary.get("final_loss") is None:
        return (f"finished: at step {summary['steps']}, no step trained by this run (the checkpoint it "
                "resumed from was already at the end; raise train.steps to train more)")
    return (f"finished: {summary['steps']} steps, loss {summary['first_loss']} -> {summary['final_loss']}, "
            f"restarts {summary['restarts']}, world sizes {summary['world_sizes']}")


@dataclasses.dataclass(frozen=True)
class Happened:
    """What the host saw of a run, for ``outcome``: whether it finished, the fatal failure
    logged, the last agent's exit-2 line (``permanent``), the signal that stopped the host,
    each agent's exit code; ``drained_at``, ``agent_exits`` and ``superseded`` as
    ``runstate.RunState`` keeps them; ``cut_short``: ranks still running
    ``policy.finish_bound_s`` after the last step; ``sessions``: worker groups that started
    the harness's session (``RunState.generations``; -1: not counted)."""

    finished: bool
    fatal: str | None
    permanent: str
    stopped_by: int | None
    codes: dict[int, int | None]
    drained_at: int | None = None
    agent_exits: Sequence[tuple[int, str]] = ()
    superseded: str = ""
    cut_short: str = ""
    sessions: int = -1


def outcome(happened: Happened) -> tuple[int, str]:
    """Pure: the host's exit code and message (``exitcodes``), from what happened. A script
    that never starts a session (a plain torchrun script) has finished when every agent
    exited 0, its workers having exited 0: then the message says so (the only OK with one)."""
    h = happened
    finished, fatal, permanent, stopped_by, codes = h.finished, h.fatal, h.permanent, h.stopped_by, h.codes
    drained_at, superseded, cut_short = h.drained_at, h.superseded, h.cut_short
    if fatal:
        return exitcodes.PERMANENT, fatal
    if finished and cut_short:
        return exitcodes.FAILED, cut_short
    if finished:
        return exitcodes.OK, ""
    if superseded:  # a fenced generation's finish is not the job's
        return exitcodes.FAILED, superseded
    if permanent:  # a crash loop (or a fatal error): restarting cannot help
        return exitcodes.PERMANENT, permanent
    if h.sessions == 0 and stopped_by is None and codes and all(c == 0 for c in codes.values()):
        return exitcodes.OK, ("the script exited 0 on every rank (it does not use elastic_harness's API, "
                              "so no steps, checkpoints or resumes were recorded)")
    saved = "no step was drained" if drained_at is None else f"drained and saved at step {drained_at}"
    if stopped_by is not None:
        return 128 + stopped_by, f"job stopped by {signal.Signals(stopped_by).name}; {saved}"
    message = _failure_message(h.agent_exits, drained_at, codes)
    kinds = {exitcodes.kind(c) for c in codes.values()}
    if "preempted" in kinds:
        return exitcodes.PREEMPTED, message
    return (exitcodes.INFRA if "infrastructure" in kinds else exitcodes.FAILED), message


# An agent's exit-2 message that is an error in the job's code (a crash loop, an exception a
# worker raised): fixing that code is the fix. Its other exit-2 messages (a rendezvous or
# etcd setting) name their own fix, or have none to name.
_CODE_ERROR = re.compile(r"crash loop|[\w.]*(Error|Exception)\b")


def _error(code: int, message: str, run_dir: Path, from_agent: bool) -> HarnessError:
    """The one line (and fix) the CLI prints for a job that did not finish."""
    resume_hint = "re-run the same command to resume from the last checkpoint"
    kind = exitcodes.kind(code)
    if kind == "permanent":  # the fix named, or nothing: a message that carries its own says it
        in_code = from_agent and "\n  fix: " not in message and _CODE_ERROR.match(message) is not None
        return HarnessError(message, f"fix the error in the code it names (its traceback is in {run_dir / 'logs'}); "
                                     "re-running then resumes from the last checkpoint" if in_code else "")
    if kind == "preempted":
        error: HarnessError = Preempted(message, resume_hint)
    else:
        error = ClusterError(message, f"see {run_dir / 'logs'}; {resume_hint}")
    error.exit_code = code
    return error


def _failure_message(agent_exits: Sequence[tuple[int, str]], drained_at: int | None,
                     codes: dict[int, int | None]) -> str:
    failed = [(c, m) for c, m in agent_exits if c]
    if failed and failed[-1][0] >= 128 and drained_at is not None:
        return f"job stopped by {failed[-1][1] or 'a signal'}; drained and saved at step {drained_at}"
    if failed:
        return f"job failed: {failed[-1][1] or 'agent exit ' + str(failed[-1][0])}"
    return f"job failed: agents exited with {codes}"
