"""The ``Scheduler`` interface and what passes through it (call order: package doc)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from elastic_harness.lifecycle.registry import JobRecord
from elastic_harness.lifecycle.state import JobStatus


@dataclass(frozen=True)
class Submission:
    """One validated job to start: the resolved spec and where its state goes."""

    spec: Any  # JobSpec, preflighted (task importable, script path absolute)
    job_file: Path  # the job YAML as the user gave it (absolute)
    job_id: str  # also the rendezvous id (registry doc)
    run_dir: Path | None  # None for Kubernetes
    overrides: list[str] = field(default_factory=list)  # --set KEY=VALUE, as given
    nodes: int | None = None  # --nodes
    options: dict = field(default_factory=dict)  # scheduler-specific (flags of `submit`)
    script_args: list[str] = field(default_factory=list)  # after a script (.py) job: the script's own
    run_flags: list[str] = field(default_factory=list)  # local: more `run` flags (--chaos, --fresh, ...)


@dataclass(frozen=True)
class LogQuery:
    follow: bool = False
    rank: int | None = None
    node: str | None = None
    since: float | None = None  # unix seconds
    all: bool = False  # show torch's INFO lines and C++ stack traces too (hidden by default)


class Scheduler(Protocol):
    """One place jobs run. Besides the calls of the package doc, each owns what is its
    alone: its name and one line for ``submit --help`` (``description``), its own flags of
    ``submit`` (``add_options``, then ``options`` reads them into ``Submission.options``),
    ``JobRecord.details`` (written by its ``submit``, read by the rest), and how a job is
    named in its terms (``where``, ``summary``). Constructed with the registry's root."""

    name: str
    description: str
    keeps_run_dir: bool  # the run directory is on storage this machine sees (False: in the cluster)

    @staticmethod
    def add_options(parser: argparse.ArgumentParser) -> None: ...

    @staticmethod
    def options(args: argparse.Namespace) -> dict: ...

    def where(self, record: JobRecord) -> str: ...

    def summary(self, record: JobRecord) -> dict: ...

    def check(self) -> None: ...

    def submit(self, submission: Submission) -> JobRecord: ...

    def status(self, record: JobRecord) -> JobStatus: ...

    def logs(self, record: JobRecord, query: LogQuery, out: TextIO) -> None: ...

    def stop(self, record: JobRecord, now: bool) -> None: ...

