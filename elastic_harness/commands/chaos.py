"""``elastic-harness chaos``: inject a fault into a running job.

Local: ``chaos RUN_DIR kill-worker:1`` asks the ``run`` supervising RUN_DIR to fire it now.
Kubernetes: ``chaos --k8s --job NAME kill-node[:I]`` deletes worker pod I with kubectl.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from elastic_harness import runfiles
from elastic_harness.chaos.inject import request
from elastic_harness.chaos.vocabulary import check_netns, parse_fault
from elastic_harness.errors import HarnessError
from elastic_harness.events import read_events
from elastic_harness.records.runstate import current_invocation


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chaos", help="inject a fault into a running job (local run dir or --k8s)")
    p.add_argument("target", help="RUN_DIR of a running local job (or, with --k8s, the fault)")
    p.add_argument("fault", nargs="?", help="KIND[:TARGET], e.g. kill-worker:1, kill-node:1, add-node")
    p.add_argument("--k8s", action="store_true", help="act on a Kubernetes job with kubectl")
    p.add_argument("--job", help="--k8s: the job name (as in the job YAML)")
    p.add_argument("--namespace", default="default", help="--k8s: namespace")
    p.add_argument("--dry-run", action="store_true", help="--k8s: print the kubectl command only")
    p.set_defaults(func=cmd_chaos)


def kubectl_kill_node(job: str, namespace: str, index: int) -> list[str]:
    """Pure: the command that deletes worker pod ``index`` (both flavors name pods so)."""
    return ["kubectl", "delete", "pod", f"{job}-worker-{index}", "--namespace", namespace,
            "--grace-period=0", "--wait=false"]


def cmd_chaos(args: argparse.Namespace) -> int:
    if args.k8s:
        return _k8s(args)
    run_dir = Path(args.target)
    if args.fault is None:
        raise HarnessError("no fault given", "e.g. elastic-harness chaos RUN_DIR kill-worker:1")
    events = current_invocation(read_events(run_dir / runfiles.EVENTS))
    if not any(e["event"] == "start" and e.get("who") == "host" for e in events):
        raise HarnessError(f"{run_dir} has no job started by `elastic-harness run`",
                           "pass the run directory of a job running on this machine")
    if any(e["event"] == "exit" and e.get("who") == "host" for e in events):
        raise HarnessError(f"the job in {run_dir} is not running (it has exited)",
                           "start it again with elastic-harness run, then inject")
    fault = parse_fault(args.fault, flag="chaos")
    if "@" in args.fault:
        raise HarnessError(f"chaos '{args.fault}': a requested fault fires now, it takes no '@'",
                           f"drop '@{args.fault.partition('@')[2]}', or pass it to run --chaos")
    host_start = next(e for e in events if e["event"] == "start" and e.get("who") == "host")
    check_netns([fault], netns=bool(host_start.get("netns")))
    path = request(run_dir, args.fault)
    print(f"requested {args.fault} ({path.name}); watch events.jsonl for the 'fault' event")
    return 0


def _k8s(args: argparse.Namespace) -> int:
    fault = parse_fault(args.target, flag="chaos --k8s")
    if fault.kind != "kill-node":
        raise HarnessError(f"--k8s supports kill-node, not {fault.kind}", "use kill-node[:INDEX]")
    if not args.job:
        raise HarnessError("--k8s needs --job NAME", "the job's name, as in its YAML")
    cmd = kubectl_kill_node(args.job, args.namespace, fault.target)
    print(" ".join(cmd))
    if args.dry_run:
        return 0
    return subprocess.run(cmd, check=False).returncode
