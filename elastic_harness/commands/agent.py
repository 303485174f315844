"""``elastic-harness agent JOB.yaml``: one node's elastic agent, as a cluster runs it.

Flags override ``PET_*`` environment variables (set by Kubeflow's operator), which override
the spec. See ``elastic_harness.launch.agent`` for exit codes.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from elastic_harness.checkpoint.lock import Holder
from elastic_harness.errors import HarnessError
from elastic_harness.launch.config import node_options
from elastic_harness.launch.scratch import torch_environ
from elastic_harness.rundir import prepare
from elastic_harness.spec import load_job


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="run one node's elastic agent (what a cluster node runs)")
    p.add_argument("job")
    p.add_argument("--run-dir", help="shared run directory (default runs/<job name>)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous store (or PET_RDZV_ENDPOINT)")
    p.add_argument("--rdzv-backend", help="c10d or etcd (or PET_RDZV_BACKEND)")
    p.add_argument("--rdzv-id", help="rendezvous id shared by the job's nodes (or PET_RDZV_ID)")
    p.add_argument("--nnodes", help="MIN:MAX nodes (or PET_NNODES)")
    p.add_argument("--nproc-per-node", type=int, help="workers on this node (or PET_NPROC_PER_NODE)")
    p.add_argument("--max-restarts", type=int, help="worker-group restarts (or PET_MAX_RESTARTS)")
    p.add_argument("--node", default="", help="a name for this node in events and logs")
    p.add_argument("--local-addr", help="this node's address, if the hostname does not resolve to it")
    host = p.add_mutually_exclusive_group()
    host.add_argument("--is-host", dest="is_host", action="store_const", const=True,
                      help="c10d: this agent hosts the rendezvous store")
    host.add_argument("--no-host", dest="is_host", action="store_const", const=False)
    p.add_argument("--endpoint-port", type=int,
                   help="serve /healthz, /progress and /metrics on this port (0 = any free port)")
    p.add_argument("--endpoint-host", default="127.0.0.1",
                   help="address the endpoint binds (default loopback; 0.0.0.0 in a pod)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_agent, is_host=None)


def cmd_agent(args: argparse.Namespace) -> int:
    """Check every option before anything is created, then prepare the run dir and run."""
    spec = load_job(args.job, args.set)
    flags = {k: getattr(args, k) for k in ("rdzv_endpoint", "rdzv_backend", "rdzv_id", "nnodes",
                                           "nproc_per_node", "max_restarts", "is_host", "local_addr")}
    run_dir = Path(args.run_dir or Path("runs") / spec.name).resolve()
    opts = node_options(spec, run_dir, flags, os.environ)
    if not opts.rdzv_id:
        raise HarnessError("no rendezvous id", "pass --rdzv-id (all of the job's nodes must share it) or set PET_RDZV_ID")
    node = args.node or os.uname().nodename
    if args.endpoint_port is not None and not 0 <= args.endpoint_port < 65536:
        raise HarnessError(f"--endpoint-port {args.endpoint_port} is not a port", "pick 0..65535 (0 = any free port)")
    # The job submission (its rendezvous id) holds the run dir: this job's agents share it.
    with prepare(run_dir, spec, holder=Holder.this_process(spec.name, opts.rdzv_id)):
        os.environ.update(torch_environ(run_dir, os.environ))  # torch's caches in the run dir, not /tmp
        return _serve(args, spec, opts, run_dir, node)


def _serve(args: argparse.Namespace, spec, opts, run_dir: Path, node: str) -> int:
    from elastic_harness.launch.agent import run_agent  # imports torch: only once all is checked

    endpoint = None
    if args.endpoint_port is not None:
        from elastic_harness.launch.endpoint import Endpoint, stall_bound

        try:
            endpoint = Endpoint(run_dir / "events.jsonl", job=spec.name, node=node,
                                host=args.endpoint_host, port=args.endpoint_port,
                                stall_s=stall_bound(spec))
        except OSError as e:  # port taken, or a host name that does not resolve here
            raise HarnessError(f"cannot serve the endpoint on {args.endpoint_host}:{args.endpoint_port}: "
                               f"{e.strerror or e}", "pick another --endpoint-port (0 = any free port) "
                               "or an address of this machine for --endpoint-host") from None
        print(f"endpoint: http://{args.endpoint_host}:{endpoint.port}/progress", flush=True)
    try:
        health = (lambda fn: setattr(endpoint, "agent_health", fn)) if endpoint is not None else None
        return run_agent(spec, opts, node=node, on_health=health)
    finally:
        if endpoint is not None:
            endpoint.close()
