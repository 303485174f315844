"""``elastic-harness k8s render``: a job YAML -> Kubernetes manifests.

Prints one multi-document YAML stream, or with ``--out DIR`` writes one file per object plus
a ``kustomization.yaml`` (how the repository's ``k8s/plain`` and ``k8s/pytorchjob`` are made).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from elastic_harness.commands.jobargs import job_of
from elastic_harness.k8s import DEFAULT_IMAGE, FLAVORS, RenderError, manifest_files, render, to_yaml


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "k8s", help="Kubernetes manifests for a job.", description="Kubernetes manifests."
    )
    actions = parser.add_subparsers(dest="k8s_action", metavar="ACTION", required=True)
    r = actions.add_parser(
        "render",
        help="Render a job to manifests (PyTorchJob or plain StatefulSets).",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("job", help="Job YAML file, or a training script (.py): its job as `run` finds it.")
    r.add_argument("--flavor", required=True, choices=FLAVORS, help="pytorchjob, plain or trainjob (k8s/DEPLOY.md says which to choose).")
    r.add_argument("--image", default=DEFAULT_IMAGE, help=f"Image (default {DEFAULT_IMAGE}).")
    r.add_argument("--namespace", default=None, help="Namespace (default: none set).")
    r.add_argument("--out", default=None, metavar="DIR", help="Write files here, not stdout.")
    r.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override a job field, e.g. --set nodes.max=4 (repeatable).",
    )
    r.set_defaults(func=run_render)


def run_render(args: argparse.Namespace) -> int:
    spec = job_of(args.job, args.overrides, note=lambda line: print(line, file=sys.stderr))
    refuse_epochs(spec)
    manifests = render(spec, args.flavor, args.image, args.namespace, script_for_pods(spec, Path(args.job)))
    if args.out is None:
        print(to_yaml(manifests), end="")
        return 0
    source = Path(args.job).as_posix()
    files = manifest_files(manifests, args.flavor, source)
    write_tree(Path(args.out), files)
    return 0


def refuse_epochs(spec) -> None:
    """``train.epochs`` is resolved into steps where the task is built before any worker
    (``run``/``submit`` locally or on Slurm); manifests carry the spec as written, so pods
    would only learn the size when training starts: refused here, with the fix."""
    if spec.train.epochs:
        from elastic_harness.errors import HarnessError

        raise HarnessError("train.epochs is resolved into train.steps by `run`/`submit` before workers "
                           "start, which Kubernetes manifests cannot do",
                           "set train.steps (`elastic-harness spec JOB` prints the steps the epochs resolve to)")


def script_for_pods(spec, job_path: Path) -> dict[str, str] | None:
    """A script job's files to ship in the ConfigMap (the pods' image does not hold them):
    the script, found as ``run`` finds it (the working directory, then next to the job
    file), and the modules beside it that it imports (``scriptfiles``), each compiled first;
    path relative to the script's directory -> text, the script first."""
    if not spec.script.path:
        return None
    from elastic_harness.commands.run import resolve_script
    from elastic_harness.commands.support.scriptfiles import check_compiles
    from elastic_harness.errors import HarnessError

    try:
        path = resolve_script(spec.script.path, job_path)
    except HarnessError as e:
        raise RenderError(f"{e.message}: the pods get the script from the job's ConfigMap",
                          "run this from the directory script.path is relative to") from None
    files = check_compiles(path)
    try:
        return {rel.as_posix(): (path.parent / rel).read_text(encoding="utf-8") for rel in files}
    except (OSError, UnicodeDecodeError) as e:
        raise RenderError(f"cannot read the script's files beside '{path}': {e}",
                          "ship readable UTF-8 Python files, or put them in the image") from None


def write_tree(out: Path, files: dict[str, str]) -> None:
    """Write the files; name any other YAML in ``out`` so stale objects do not linger."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (out / name).write_text(text)
    except OSError as e:
        raise RenderError(f"cannot write to '{out}': {e.strerror}", "check --out") from None
    for name in sorted(files):
        print(out / name)
    stale = sorted(p.name for p in out.glob("*.yaml") if p.name not in files)
    if stale:
        print(
            f"note: {out} also holds {', '.join(stale)}, not part of this render: remove if stale"
        )
