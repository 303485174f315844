"""``elastic-harness agent JOB.yaml``: one node's elastic agent, as a cluster runs it.

It speaks torchrun's language (``--nnodes MIN:MAX``, ``--nproc-per-node N|gpu|cpu|auto``,
``--rdzv-backend/--rdzv-endpoint/--rdzv-id/--rdzv-conf``, ``--max-restarts``,
``--standalone``, ``--local-addr``). Each value comes from its flag, else its ``PET_*``
variable (Kubeflow's operator sets them), else Slurm's variables inside an allocation
(``launch.slurm_env``), else the job file; ``launch.config.node_options`` merges them.

It prints the job's progress like ``run`` and writes ``summary.json`` when it exits (unless
``--no-progress`` / ``--no-summary``: the ``run`` that starts local agents does both). Its log
(stdout) starts with a header naming node and job, and names its workers' log directory
once torchelastic made it (``lifecycle.logsource``): ``elastic-harness logs`` relies on
both. Exit codes: ``agent.node`` and ``exitcodes``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from elastic_harness import runfiles
from elastic_harness.checkpoint.lock import Holder
from elastic_harness.deps import require_spec_extras
from elastic_harness.errors import HarnessError
from elastic_harness.launch import slurm_env
from elastic_harness.launch.config import node_options, worker_malloc_environ
from elastic_harness.launch.scratch import torch_environ
from elastic_harness.lifecycle import logsource
from elastic_harness.records.rundir import handed_resolved, prepare
from elastic_harness.spec import backends, load_job
from elastic_harness.torchcompat.host import check_and_warn, check_release


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="run one node's elastic agent (what a cluster node runs)")
    p.add_argument("job")
    p.add_argument("--run-dir", help="shared run directory (default runs/<job name>)")
    p.add_argument("--rdzv-endpoint", help="HOST[:PORT] of the rendezvous (or PET_RDZV_ENDPOINT; c10d port 29400)")
    p.add_argument("--rdzv-backend", help=f"{', '.join(backends.NAMES)} (or PET_RDZV_BACKEND)")
    p.add_argument("--rdzv-id", help="rendezvous id shared by the job's nodes (or PET_RDZV_ID)")
    p.add_argument("--rdzv-conf", metavar="K=V,...",
                   help="rendezvous settings over the job's, e.g. join_timeout=900 (or PET_RDZV_CONF)")
    p.add_argument("--standalone", action="store_true", default=None,
                   help="a c10d rendezvous on this machine at a free port, with a fresh id (or PET_STANDALONE)")
    p.add_argument("--nnodes", help="N or MIN:MAX nodes (or PET_NNODES)")
    p.add_argument("--nproc-per-node", help="workers on this node: N, gpu, cpu or auto (or PET_NPROC_PER_NODE)")
    p.add_argument("--max-restarts", type=int, help="worker-group restarts (or PET_MAX_RESTARTS)")
    p.add_argument("--job-id", help="the submission this agent belongs to, which holds the run dir "
                                    "(default: the rendezvous id)")
    p.add_argument("--submission", default="",
                   help="token of the submission this agent belongs to (`run` passes its own): the run "
                        "dir's lock then refuses another submission that pinned the same rendezvous id")
    p.add_argument("--node", default="", help="a name for this node in events and logs "
                                              "(default: SLURM_NODEID in an allocation, else the host name)")
    p.add_argument("--local-addr", help="this node's address, if the hostname does not resolve to it")
    host = p.add_mutually_exclusive_group()
    host.add_argument("--is-host", dest="is_host", action="store_const", const=True,
                      help="c10d: this agent hosts the rendezvous store")
    host.add_argument("--no-host", dest="is_host", action="store_const", const=False)
    p.add_argument("--endpoint-port", type=int,
                   help="serve /healthz, /progress and /metrics on this port (0 = any free port)")
    p.add_argument("--endpoint-host", default="127.0.0.1",
                   help="address the endpoint binds (default loopback; 0.0.0.0 in a pod)")
    p.add_argument("--no-progress", action="store_true",
                   help="print no progress lines (the `run` that started this agent prints them)")
    p.add_argument("--no-summary", action="store_true",
                   help="write no summary.json (the `run` that started this agent writes it once "
                        "every agent exited; reading a long run's whole log takes a while)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_agent, is_host=None, fast_exit=True)


_FLAGS = ("rdzv_endpoint", "rdzv_backend", "rdzv_id", "rdzv_conf", "standalone", "nnodes",
          "nproc_per_node", "max_restarts", "is_host", "local_addr")


def cmd_agent(args: argparse.Namespace) -> int:
    """Check every option before anything is created, then prepare the run dir and run."""
    from elastic_harness.simcluster.cluster import free_port

    spec = load_job(args.job, args.set)  # the one parse of the job in this process
    require_spec_extras(spec)
    check_release()  # a torch below the range, before anything (the rest: ``_serve_with``)
    run_dir = Path(args.run_dir or Path("runs") / spec.name).resolve()
    # Given the run dir's resolved spec (by `run`, its owner): the workers read that file,
    # so this agent neither rewrites it nor runs another job over it.
    owner_wrote = handed_resolved(args.job, run_dir)
    if owner_wrote and args.set:
        raise HarnessError(f"--set cannot change {args.job}: it is the job this run directory's "
                           "owner resolved, and the workers read it as written",
                           "pass the job's own YAML with --set, or set the values where the job is submitted")
    opts = node_options(spec, run_dir, {k: getattr(args, k) for k in _FLAGS}, os.environ, pick_port=free_port)
    if not opts.rdzv_id:
        raise HarnessError("no rendezvous id", "pass --rdzv-id (all of the job's nodes must share it) or set PET_RDZV_ID")
    node = args.node or slurm_env.node_name(os.environ) or os.uname().nodename
    if args.endpoint_port is not None and not 0 <= args.endpoint_port < 65536:
        raise HarnessError(f"--endpoint-port {args.endpoint_port} is not a port", "pick 0..65535 (0 = any free port)")
    job_id = args.job_id or opts.rdzv_id
    # The job submission holds the run dir: this job's agents (and its `run`) share it.
    with prepare(run_dir, spec, holder=Holder.this_process(spec.name, job_id, submission=args.submission),
                 key_file=opts.key_file, record_spec=not owner_wrote) as claim:
        os.environ.update(torch_environ(run_dir, os.environ))  # torch's caches in the run dir, not /tmp
        os.environ.update(worker_malloc_environ(os.environ))  # before the zygote starts (launch.config)
        print(logsource.agent_header(node, job_id, os.getpid(), time.time()), flush=True)
        code = _serve(args, spec, opts, run_dir, node, job_id, claim.lost)
        if not args.no_summary:
            _write_summary(run_dir)
        return code


def _serve(args: argparse.Namespace, spec, opts, run_dir: Path, node: str, job_id: str, lock_lost) -> int:
    from elastic_harness.agent.zygote import Zygote, release_inherited
    from elastic_harness.runtime.zygote import preload_for  # stdlib only: the zygote imports torch

    # Warm starts: the zygote imports torch and the harness (seconds) while this process
    # does and the first rendezvous runs, so it is started before anything here imports torch
    # (or, forked by its host's zygote, this agent adopts the zygote forked with it).
    zygote = Zygote(preload_for(tensorboard=spec.metrics.tensorboard)) if spec.warm_start else None
    if zygote is not None:
        zygote.start()
    else:
        release_inherited()
    try:
        return _serve_with(args, spec, opts, run_dir, node, job_id, zygote, lock_lost)
    finally:
        if zygote is not None:
            zygote.stop()


def _serve_with(args: argparse.Namespace, spec, opts, run_dir: Path, node: str, job_id: str, zygote,
                lock_lost) -> int:
    from elastic_harness.agent.node import run_agent  # imports torch: only once all is checked

    # The build and every private name: here, while the zygote imports torch (no start-up
    # cost); a refusal stops the zygote (``_serve``) before any rendezvous or worker.
    check_and_warn(spec)

    endpoint = None
    if args.endpoint_port is not None:
        from elastic_harness.agent.endpoint import Endpoint, Serving, stall_bound

        try:
            endpoint = Endpoint(run_dir / runfiles.EVENTS, job=spec.name, node=node,
                                serving=Serving(host=args.endpoint_host, port=args.endpoint_port,
                                                stall_s=stall_bound(spec)))
        except OSError as e:  # port taken, or a host name that does not resolve here
            raise HarnessError(f"cannot serve the endpoint on {args.endpoint_host}:{args.endpoint_port}: "
                               f"{e.strerror or e}", "pick another --endpoint-port (0 = any free port) "
                               "or an address of this machine for --endpoint-host") from None
        print(f"endpoint: http://{args.endpoint_host}:{endpoint.port}/progress", flush=True)
    _announce_worker_logs(node, job_id)
    progress = None if args.no_progress else _ProgressPrinter(run_dir / runfiles.EVENTS, spec.train.steps)
    try:
        health = (lambda fn: setattr(endpoint, "agent_health", fn)) if endpoint is not None else None
        return run_agent(spec, opts, node=node, on_health=health, zygote=zygote, lock_lost=lock_lost)
    finally:
        if progress is not None:
            progress.close()
        if endpoint is not None:
            endpoint.close()


def _announce_worker_logs(node: str, job_id: str) -> None:
    """Name the workers' log directory in this agent's log when torchelastic creates it.

    torchelastic picks a random directory per agent (``DefaultLogsSpecs``) and logs it at
    INFO ("log directory set to: %s"); its loggers default to WARNING, so that one logger
    is lowered and its record turned into ``logsource.worker_dir_line``.
    """
    import torch.distributed.elastic.multiprocessing.api as mp_api

    class Announce(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if str(record.msg).startswith("log directory set to") and record.args:
                print(logsource.worker_dir_line(node, job_id, str(record.args[0])), flush=True)

    logger = logging.getLogger(mp_api.__name__)
    logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
    logger.addHandler(Announce(level=logging.INFO))


class _ProgressPrinter:
    """``run``'s progress lines, from the events appended while this agent runs."""

    def __init__(self, events_path: Path, total_steps: int, period_s: float = 0.5) -> None:
        from elastic_harness.commands.support.progress import Progress
        from elastic_harness.events import EventTail

        self._tail = EventTail(events_path, start_at_end=True)
        self._progress = Progress(total_steps, out=sys.stderr)
        self._stop = threading.Event()
        self._period = period_s
        self._thread = threading.Thread(target=self._loop, name="agent-progress", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._period):
            self._show()

    def _show(self) -> None:
        for e in self._tail.read():
            try:
                self._progress.update(e)
            except (KeyError, TypeError, ValueError):
                continue  # a line outside the contract: skip it, keep following

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._show()
        self._progress.close()


def _write_summary(run_dir: Path) -> None:
    """``summary.json`` from the whole log, written whole (several agents may write it; the
    ``run`` that started them, if any, writes it again after they all exit)."""
    from elastic_harness.events import read_events
    from elastic_harness.records.summary import summarize

    path = run_dir / runfiles.SUMMARY
    tmp = path.with_name(f".{runfiles.SUMMARY}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(summarize(read_events(run_dir / runfiles.EVENTS)), indent=2))
        os.replace(tmp, path)
    except OSError as e:
        print(f"warning: cannot write {path}: {e.strerror or e}", file=sys.stderr)
