"""``elastic-harness spec``: the job YAML reference, or a job validated and resolved."""

from __future__ import annotations

import argparse

from elastic_harness.spec import describe, dump_job, load_job


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("spec", help="print every job field with its default and meaning, "
                                    "or validate a job and print it resolved")
    p.add_argument("job", nargs="?", help="a job YAML to validate and resolve")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.set_defaults(func=cmd_spec)


def cmd_spec(args: argparse.Namespace) -> int:
    if args.job:
        print(dump_job(load_job(args.job, args.set)), end="")
        return 0
    rows = describe()
    width = max(len(key) for key, _, _ in rows)
    for key, default, text in rows:
        shown = f"  (default {default})" if default else ""
        print(f"{key:<{width}}  {text}{shown}")
    return 0
