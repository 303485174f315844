"""The job spec: one frozen, typed, validated object per job YAML.

Every field carries one line of documentation in its metadata; ``elastic-harness spec``
prints that text. Each class checks its own ranges in ``__post_init__`` and raises
``SpecError`` naming the field. Cross-field rules live in ``JobSpec.__post_init__``.
This module is pure: no I/O, no torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from elastic_harness.errors import SpecError, SpecErrors
from elastic_harness.spec import backends, layout


def doc(default: Any, text: str, **kw: Any) -> Any:
    """A dataclass field with a default and one line of documentation."""
    if isinstance(default, (dict, list)):
        factory = (lambda d=default: type(d)(d))  # noqa: E731
        return field(default_factory=factory, metadata={"doc": text, **kw})
    return field(default=default, metadata={"doc": text, **kw})


# The longest wait a timeout may ask for: a week. Longer ones overflow what they become (a
# timedelta for torch's process groups, C++ chrono milliseconds, an etcd lease TTL) or
# mean "never" by accident; 0 says "never" where a field allows it.
MAX_WAIT_S = 7 * 24 * 3600


def _positive(path: str, value: float, allow_zero: bool = False, most: float | None = None) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise SpecError(path, f"must be a finite number, got {value}", "write a number of seconds or a count")
    if value < 0 or (value == 0 and not allow_zero):
        need = ">= 0" if allow_zero else "> 0"
        raise SpecError(path, f"must be {need}, got {value}")
    if most is not None and value > most:
        days = f" ({most / 86400:g} days)" if most == MAX_WAIT_S else ""
        raise SpecError(path, f"must be at most {most:g}{days}, got {value:g}",
                        f"set {path} to {most:g} or less" + (" (0: never)" if allow_zero else ""))


def _waits(prefix: str, spec: object, names: tuple[str, ...], allow_zero: tuple[str, ...] = ()) -> None:
    """Each field a positive number of seconds up to ``MAX_WAIT_S`` (0 allowed where named)."""
    for name in names:
        _positive(f"{prefix}.{name}", getattr(spec, name), allow_zero=name in allow_zero, most=MAX_WAIT_S)


@dataclass(frozen=True)
class Removed:
    """A key this schema had once. ``still_meant``: values that ask for what happens now
    (every resolved spec of that release records the default, so those are dropped
    silently); any other value is refused with what to use instead."""

    version: str
    still_meant: tuple
    why: str
    instead: str


REMOVED: dict[str, Removed] = {  # dotted key -> what became of it
    "checkpoint.writer": Removed(
        "0.3", ("thread",),
        "the writer process cost more step time than the default thread (+13.7% vs +11.3%, docs/benchmarks-history.md)",
        "delete the key: async saves are written by a background thread of each worker"),
}


@dataclass(frozen=True)
class TaskSpec:
    target: str = doc(
        "",
        "Import path 'package.module:callable' returning a Task (model, dataset, loss); "
        "or leave empty and name a script.",
    )
    args: dict = doc({}, "Keyword arguments passed to the task callable.")

    def __post_init__(self) -> None:
        if not self.target:
            return
        mod, sep, attr = self.target.partition(":")
        if not sep or not mod or not attr:
            raise SpecError(
                "task.target",
                f"'{self.target}' is not of the form 'package.module:callable'",
                "write e.g. 'elastic_harness.tasks.charlm:CharLM'",
            )


@dataclass(frozen=True)
class ScriptSpec:
    """Your own training script instead of a task: it calls ``elastic_harness.init()``."""

    path: str = doc(
        "", "Your training script (a .py file using elastic_harness.init()); run instead of a task."
    )
    args: list = doc([], "Command-line arguments passed to the script (a list of strings).")

    def __post_init__(self) -> None:
        if self.path and not self.path.endswith(".py"):
            raise SpecError("script.path", f"'{self.path}' is not a .py file", "name a Python script")
        bad = [a for a in self.args if not isinstance(a, (str, int, float))]
        if bad:
            raise SpecError("script.args", f"must be a list of strings, got {bad[0]!r}")


@dataclass(frozen=True)
class NodesSpec:
    min: int = doc(1, "Fewest nodes (elastic agents) the job trains on.")
    max: int = doc(1, "Most nodes; extra nodes wait until a membership change admits them.")
    spares: int = doc(
        0,
        "Hot spares: agents beyond nodes.max that join the rendezvous and stay idle (torch's "
        "redundancy list) until a node is lost; one then takes its place at the same world size "
        "(no reshard). `run` starts them once the group formed; Slurm and Kubernetes start them "
        "with the others (one more node each); at most nodes.max.",
    )
    exclude_after: int = doc(
        2,
        "A node judged gone (dropped from the rendezvous while its agent lived: frozen, cut off) "
        "or whose worker hung this many times within exclude_window seconds is kept out: its "
        "agent stops (exit 200) and `report` names it; 0 = never.",
    )
    exclude_window: float = doc(600.0, "Seconds over which nodes.exclude_after counts a node's failures.")

    def __post_init__(self) -> None:
        _positive("nodes.min", self.min)
        _positive("nodes.max", self.max)
        _positive("nodes.spares", self.spares, allow_zero=True)
        _positive("nodes.exclude_after", self.exclude_after, allow_zero=True)
        _positive("nodes.exclude_window", self.exclude_window, most=MAX_WAIT_S)
        if self.min > self.max:
            raise SpecError(
                "nodes", f"min ({self.min}) is greater than max ({self.max})", "set min <= max"
            )
        if self.spares > self.max:
            raise SpecError(
                "nodes.spares", f"{self.spares} spares for a job of at most {self.max} nodes: more "
                "than it can ever hold in its place at once", f"set nodes.spares to at most {self.max}"
            )


def _check_endpoint(endpoint: str) -> None:
    """One ``HOST:PORT`` of ``rendezvous.endpoint``: no scheme (the protocol is
    ``etcd_protocol``'s), a host, a port 1..65535 (``[V6]:PORT`` for IPv6)."""
    where, fix = "rendezvous.endpoint", "write HOST:PORT, e.g. 127.0.0.1:2379 (several: comma-separated)"
    scheme, sep, rest = endpoint.partition("://")
    if sep:
        raise SpecError(where, f"'{endpoint}' has a scheme ({scheme}://)",
                        f"write {rest.rstrip('/')} (rendezvous.etcd_protocol says http or https)")
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port:
        raise SpecError(where, f"'{endpoint}' has no port", fix)
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise SpecError(where, f"'{endpoint}': port '{port}' is not a number from 1 to 65535", fix)
    if not host.strip("[]") or any(c.isspace() or c in "/?#@" for c in host):
        raise SpecError(where, f"'{endpoint}': '{host}' is not a host name or address", fix)


@dataclass(frozen=True)
class RendezvousSpec:
    backend: Literal[backends.NAMES] = doc(  # the choices: spec/backends.py's table
        "c10d", "Rendezvous backend: c10d (store inside one agent), etcd (an etcd 3.4+ server, its "
        "v3 API), or etcd-v2 (torch's own, for an etcd 3.4/3.5 run with --enable-v2)."
    )
    endpoint: str = doc(
        "", "HOST:PORT of the rendezvous store; etcd: HOST:PORT,HOST:PORT,... of its members (the "
        "client fails over between them); empty = 127.0.0.1 with a free port (local runs)."
    )
    id: str = doc("", "Rendezvous id; empty = a fresh unique id per submission (recommended).")
    join_timeout: int = doc(120, "Seconds to wait for nodes.min nodes before failing.")
    start_last_call_timeout: int = doc(
        15,
        "First rendezvous of a submission: seconds to wait for more nodes once nodes.min have "
        "joined (agents start together, not at once); ends early when nodes.max have joined.",
    )
    last_call_timeout: int = doc(
        2,
        "Later rendezvous rounds: seconds to wait for the other nodes waiting to rejoin once "
        "nodes.min have joined, 0.5 at least (two of their reads of the state, one every 0.25 s); none when no "
        "other node is waiting (torch default 30).",
    )
    close_timeout: int = doc(10, "Seconds for the rendezvous to close on shutdown.")
    heartbeat_timeout: int = doc(5, "Seconds within which a keep-alive must complete.")
    keep_alive_interval: int = doc(1, "Seconds between agent keep-alives (torch default 5).")
    keep_alive_max_attempt: int = doc(
        3,
        "Missed keep-alives before a node is declared dead (torch default 3): a lost node is "
        "dropped interval x attempts after its last keep-alive. Too short drops a live but busy "
        "agent (2 s did on a loaded 2-core machine: a new agent then formed a second group); "
        "keep interval x attempts >= 3. A node whose peers saw its connection close and whose "
        "agent process is gone (or silent for 2 intervals, on another host) is dropped at once "
        "(rendezvous.liveness).",
    )
    etcd_protocol: Literal["http", "https"] = doc("http", "etcd: http, or https for client TLS.")
    etcd_ca_cert: str = doc("", "etcd https: CA bundle path used to verify the server.")
    etcd_cert: str = doc("", "etcd https: client certificate path (mutual TLS).")
    etcd_key: str = doc("", "etcd https: client key path (with etcd_cert).")
    etcd_user: str = doc("", "etcd (v3) authentication: user name, with etcd_password_file.")
    etcd_password_file: str = doc(
        "", "etcd (v3) authentication: path of a file holding the user's password (e.g. a mounted Secret)."
    )
    isolation_timeout: float = doc(
        20.0, "An agent that cannot reach the rendezvous this long stops itself; 0 = never."
    )

    def __post_init__(self) -> None:
        _waits("rendezvous", self, ("join_timeout", "start_last_call_timeout", "last_call_timeout",
                                    "close_timeout", "heartbeat_timeout", "keep_alive_interval",
                                    "isolation_timeout"), allow_zero=("isolation_timeout",))
        _positive("rendezvous.keep_alive_max_attempt", self.keep_alive_max_attempt, most=1000)
        if self.etcd_key and not self.etcd_cert:
            raise SpecError("rendezvous.etcd_key", "given without etcd_cert", "set both or neither")
        if (self.etcd_ca_cert or self.etcd_cert) and self.etcd_protocol != "https":
            raise SpecError("rendezvous.etcd_protocol", "TLS files given but protocol is http",
                            "set etcd_protocol: https")
        for endpoint in self.endpoint.split(",") if self.endpoint else []:
            _check_endpoint(endpoint.strip())
        self._check_auth()

    def _check_auth(self) -> None:
        if bool(self.etcd_user) != bool(self.etcd_password_file):
            given, missing = (("etcd_user", "etcd_password_file") if self.etcd_user
                              else ("etcd_password_file", "etcd_user"))
            raise SpecError(f"rendezvous.{given}", f"given without {missing}", "set both or neither")
        if self.etcd_user and self.backend not in backends.WITH_USER:
            raise SpecError("rendezvous.etcd_user", f"authentication needs backend: etcd (not {self.backend})",
                            "set rendezvous.backend: etcd (torch's etcd-v2 client has no user and password)")


@dataclass(frozen=True)
class TrainSpec:
    steps: int = doc(100, "Optimizer steps to train for (the run ends after this many).")
    epochs: int = doc(
        0,
        "Instead of steps: full passes over the data; the host sets steps = ceil(epochs x "
        "dataset size / global_batch_size) before workers start (the last step is completed "
        "from the next pass; docs/script-api.md). Task jobs; a stream needs its shard lengths. "
        "0 = use steps; not with steps.",
    )
    global_batch_size: int = doc(
        32, "Samples per optimizer step, over all ranks; constant whatever the world size."
    )
    micro_batch_size: int = doc(
        8, "Most samples one rank puts through forward/backward at once (accumulation unit)."
    )
    seed: int = doc(0, "Seed for model init, data order and per-step randomness.")
    log_every: int = doc(1, "Write a 'step' event every this many steps.")
    record_samples: bool = doc(
        False, "Log the dataset indices each rank used per step to RUN_DIR/samples/ (audits)."
    )
    precision: Literal["fp32", "bf16", "fp16"] = doc(
        "fp32",
        "Autocast precision of forward and loss: fp32, bf16 (CPU or CUDA), or fp16 (CUDA only, "
        "with a GradScaler whose state is checkpointed).",
    )
    compile: bool = doc(False, "torch.compile the model after wrapping it (task path).")

    def __post_init__(self) -> None:
        _positive("train.steps", self.steps)
        _positive("train.epochs", self.epochs, allow_zero=True)
        _positive("train.global_batch_size", self.global_batch_size)
        _positive("train.micro_batch_size", self.micro_batch_size)
        _positive("train.log_every", self.log_every)
        _positive("train.seed", self.seed, allow_zero=True)


@dataclass(frozen=True)
class OptimizerSpec:
    name: Literal["adamw", "sgd"] = doc("adamw", "Optimizer: adamw or sgd.")
    lr: float = doc(1e-3, "Peak learning rate.")
    weight_decay: float = doc(0.0, "Decoupled weight decay (adamw) or L2 (sgd).")
    betas: list = doc([0.9, 0.95], "AdamW betas [beta1, beta2].")
    momentum: float = doc(0.0, "SGD momentum.")
    grad_clip: float = doc(0.0, "Clip the global gradient norm to this value; 0 = off.")
    warmup_steps: int = doc(0, "Linear warm-up steps from 0 to lr.")
    schedule: Literal["constant", "cosine"] = doc(
        "constant", "LR after warm-up: constant, or cosine decay to min_lr_ratio * lr."
    )
    min_lr_ratio: float = doc(0.1, "Final LR as a fraction of lr (cosine only).")

    def __post_init__(self) -> None:
        _positive("optimizer.lr", self.lr)
        _positive("optimizer.weight_decay", self.weight_decay, allow_zero=True)
        _positive("optimizer.grad_clip", self.grad_clip, allow_zero=True)
        _positive("optimizer.warmup_steps", self.warmup_steps, allow_zero=True)
        if len(self.betas) != 2 or not all(0 <= float(b) < 1 for b in self.betas):
            raise SpecError("optimizer.betas", f"must be two numbers in [0, 1), got {self.betas}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise SpecError("optimizer.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")


@dataclass(frozen=True)
class EvalSpec:
    every_steps: int = doc(
        0, "Evaluate every this many steps and after the last one; 0 = never (task path)."
    )
    batch_size: int = doc(0, "Samples per evaluation batch on each rank; 0 = train.micro_batch_size.")

    def __post_init__(self) -> None:
        _positive("eval.every_steps", self.every_steps, allow_zero=True)
        _positive("eval.batch_size", self.batch_size, allow_zero=True)


@dataclass(frozen=True)
class DataSpec:
    """How items are loaded. Which items a step uses never depends on these settings."""

    workers: int = doc(
        0,
        "Loader processes per rank that fetch the items the harness chose, ahead of compute; "
        "0 = fetch in the training process.",
    )
    prefetch: int = doc(2, "Micro-batches each loader process prepares ahead (workers > 0).")
    pin_memory: bool = doc(True, "Pin loaded batches in host memory for faster GPU copies (CUDA).")

    def __post_init__(self) -> None:
        _positive("data.workers", self.workers, allow_zero=True)
        _positive("data.prefetch", self.prefetch)


@dataclass(frozen=True)
class MetricsSpec:
    tensorboard: bool = doc(
        False, "Write step and evaluation metrics as TensorBoard event files to RUN_DIR/tensorboard "
        "(needs the tensorboard extra: pip install 'elastic-harness[tensorboard]')."
    )


@dataclass(frozen=True)
class CheckpointSpec:
    dir: str = doc("", "Where checkpoints go; empty = RUN_DIR/checkpoints. Local path or s3://.")
    every_steps: int = doc(50, "Save every this many steps; 0 = only by time and at the end.")
    every_seconds: float = doc(0.0, "Also save when this many seconds passed since the last save.")
    keep: int = doc(3, "Keep the newest K complete checkpoints (K >= 2).")
    keep_every: int = doc(0, "Also keep every checkpoint whose step is a multiple of this; 0 = off.")
    save_final: bool = doc(True, "Save at the last step.")
    async_save: bool = doc(
        True, "Write in the background after staging to host memory (one save in flight)."
    )
    verify: Literal["full", "size", "none"] = doc(
        "full", "On load, check the manifest: full checksums, sizes only, or nothing."
    )
    give_up_after: float = doc(
        120.0, "Stop the job once periodic saves have kept failing this many seconds (and at least "
        "3 times in a row): a brief full disk or storage hiccup is ridden out, training going on "
        "unsaved meanwhile (the in-memory snapshots still cover a crash); 0 = at the 3rd failure in a row."
    )
    memory_every: int = doc(
        1, "Also keep each rank's state in its agent's memory, at most every this many steps: a "
        "restart after a worker crash restores it with no storage read; under DDP also a lost "
        "node (survivors' memory) and a joining one (from a peer); under FSDP, see memory_buddy. Two copies of each rank's state in host memory; 0 = off."
    )
    memory_buddy: bool = doc(
        True, "Under FSDP on several nodes, each rank also keeps in its agent's memory a copy of "
        "the newest snapshot of the same local rank on the next node, sent in the background: a "
        "lost node's shards are then resharded from the survivors' memory, with no storage read. "
        "Two more copies of a rank's state in host memory."
    )
    memory_budget: float = doc(
        0.03, "Spread the in-memory snapshots out so that copying the state costs at most this "
        "share of step time (measured while training; a crash then redoes fewer steps than the "
        "interval chosen); 0 = exactly every memory_every steps."
    )
    memory_on_failure: bool = doc(
        True, "Under DDP, a rank that fails, or whose peer failed, first keeps the step it last "
        "completed in its agent's memory, when its state has not changed since (the failure came "
        "before its next optimizer step): the restart redoes no step, and the periodic snapshots, "
        "a fallback then, spend a third of memory_budget. Not for a model with persistent buffers "
        "(BatchNorm's running statistics change in the forward pass): those snapshot as before."
    )
    memory_probe: int = doc(
        0, "Measure what the in-memory tier costs this job: snapshots are off during every "
        "second block of this many steps (from step 1: on, off, on, ...), and `elastic-harness "
        "report` compares the blocks' step times; steps in an off block are protected by "
        "storage only. 0 = off (the default)."
    )

    def __post_init__(self) -> None:
        _positive("checkpoint.every_steps", self.every_steps, allow_zero=True)
        _positive("checkpoint.memory_every", self.memory_every, allow_zero=True)
        _positive("checkpoint.memory_budget", self.memory_budget, allow_zero=True)
        _positive("checkpoint.memory_probe", self.memory_probe, allow_zero=True)
        if self.memory_budget > 1:
            raise SpecError("checkpoint.memory_budget", f"must be a share of step time in [0, 1], got "
                            f"{self.memory_budget}", "e.g. 0.03 for 3 %, or 0 for a fixed interval")
        _positive("checkpoint.every_seconds", self.every_seconds, allow_zero=True, most=MAX_WAIT_S)
        _positive("checkpoint.give_up_after", self.give_up_after, allow_zero=True, most=MAX_WAIT_S)
        _positive("checkpoint.keep_every", self.keep_every, allow_zero=True)
        if self.keep < 2:
            raise SpecError(
                "checkpoint.keep",
                f"must be >= 2, got {self.keep}",
                "keep at least two: the newest may be the one a crash interrupted",
            )


@dataclass(frozen=True)
class TimeoutsSpec:
    process_group: int = doc(
        120, "Seconds before a stuck collective fails (gloo's own default is 30 minutes)."
    )
    shutdown_grace: int = doc(
        30, "Seconds workers get after SIGTERM to finish the step and save before SIGKILL."
    )
    monitor_interval: float = doc(
        0.05, "Seconds between the agent's checks of its workers (half of it is the mean delay before a "
        "crashed worker is noticed)."
    )
    step: float = doc(
        60.0, "Seconds one training step may take before the watchdog kills the worker; 0 = off."
    )

    def __post_init__(self) -> None:
        _waits("timeouts", self, ("process_group", "shutdown_grace", "monitor_interval", "step"),
               allow_zero=("step",))


@dataclass(frozen=True)
class FaultSpec:
    kind: Literal[
        "kill-worker", "kill-node", "add-node", "preempt", "hang", "hang-node", "partition", "heal"
    ] = doc(
        "kill-worker",
        "What to do: kill-worker, kill-node, add-node, preempt, hang (a rank), hang-node "
        "(SIGSTOP a node's agent and workers), partition, heal (link up).",
    )
    target: int = doc(0, "Global rank (kill-worker, hang) or node index (others).")
    at_step: int = doc(0, "Fire when the job first completes this step; 0 = use at_seconds.")
    at_seconds: float = doc(0.0, "Fire this many seconds after the job started.")
    duration: float = doc(
        0.0, "partition: seconds until the link comes back; hang-node: until the node is thawed; 0 = never."
    )
    during: Literal["", "backward", "reduction"] = doc(
        "", "kill-worker/kill-node at a step: fire during the next step's backward pass or gradient "
        "reduction instead of after the step ('' = after it)."
    )

    def __post_init__(self) -> None:
        _positive("chaos[].target", self.target, allow_zero=True)
        if self.during and (self.kind not in ("kill-worker", "kill-node") or not self.at_step):
            raise SpecError("chaos[].during", f"'{self.kind}' cannot fire during a step's {self.during}",
                            "only kill-worker and kill-node keyed by a step (@STEP) can")
        _positive("chaos[].duration", self.duration, allow_zero=True)
        _positive("chaos[].at_step", self.at_step, allow_zero=True)
        _positive("chaos[].at_seconds", self.at_seconds, allow_zero=True)
        if self.at_step == 0 and self.at_seconds == 0:
            raise SpecError("chaos[]", f"fault '{self.kind}' has neither at_step nor at_seconds")


# Kubernetes quantity ("2", "500m", "8Gi", "1e3"): the API server's pattern, sign excluded.
_QUANTITY = re.compile(
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(?P<unit>([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]+))?$"
)
# DNS-1123 subdomain: what Kubernetes accepts as a Secret name.
_DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def _quantity(path: str, value: str) -> None:
    match = _QUANTITY.match(value)
    number = value[: match.start("unit")] if match and match.group("unit") else value
    if not match or float(number) == 0:
        raise SpecError(path, f"'{value}' is not a positive Kubernetes quantity", "e.g. '500m', '8Gi'")


@dataclass(frozen=True)
class DeploySpec:
    """How ``elastic-harness k8s render`` deploys the job; local runs ignore this section."""

    endpoint_port: int = doc(
        8080, "Port of the agent's HTTP endpoint; Kubernetes probes GET /healthz on it."
    )
    rdzv_port: int = doc(
        29400, "Port of the c10d store on the first worker pod (PyTorchJob flavor, c10d)."
    )
    cpu: str = doc("2", "CPU request per node pod; a string in YAML: '2' or '500m'.")
    memory: str = doc("8Gi", "Memory request and limit per node pod (Kubernetes quantity).")
    gpus: int = doc(0, "GPUs per node pod (nvidia.com/gpu); device cuda needs >= nproc_per_node.")
    shm_size: str = doc("1Gi", "Size of the in-memory /dev/shm volume (data loaders, NCCL).")
    storage: str = doc("20Gi", "Size of the ReadWriteMany volume holding runs and checkpoints.")
    storage_class: str = doc(
        "", "StorageClass of that volume (must offer ReadWriteMany); empty = cluster default."
    )
    s3_secret: str = doc(
        "aws-credentials",
        "Secret with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, used for s3:// checkpoints.",
    )
    etcd_image: str = doc(
        "quay.io/coreos/etcd:v3.6.14", "etcd image for the rendezvous (its v3 API: etcd 3.4 or newer)."
    )
    run_as_user: int = doc(
        10001, "Non-root UID and GID of every container; k8s/Dockerfile creates this user."
    )
    grace_margin: int = doc(
        15, "Seconds added to timeouts.shutdown_grace for the pod's termination grace period."
    )

    def __post_init__(self) -> None:
        for name in ("endpoint_port", "rdzv_port"):
            port = getattr(self, name)
            if not 1 <= port <= 65535:
                raise SpecError(f"deploy.{name}", f"must be a port in 1..65535, got {port}")
        if self.endpoint_port == self.rdzv_port:
            raise SpecError("deploy.rdzv_port", f"equals deploy.endpoint_port ({self.rdzv_port})")
        for name in ("cpu", "memory", "shm_size", "storage"):
            _quantity(f"deploy.{name}", getattr(self, name))
        _positive("deploy.gpus", self.gpus, allow_zero=True)
        _positive("deploy.grace_margin", self.grace_margin)
        _positive("deploy.run_as_user", self.run_as_user)  # 0 is root
        if not _DNS1123.match(self.s3_secret):
            raise SpecError("deploy.s3_secret", f"'{self.s3_secret}' is not a valid Secret name")
        if not self.etcd_image:
            raise SpecError("deploy.etcd_image", "must not be empty")


@dataclass(frozen=True)
class JobSpec:
    name: str = doc("job", "Job name: names the run directory and the Kubernetes objects.")
    task: TaskSpec = doc(TaskSpec(), "The model, data and loss to train (or use script).")
    script: ScriptSpec = doc(ScriptSpec(), "Your own training script (instead of task).")
    parallelism: Any = doc(
        "ddp", "ddp (replicated), fsdp (FSDP2 sharding), or a mesh {replicate: auto, shard: S, tensor: T}: "
        "shard x tensor within a node (divides nproc_per_node), replicate follows the nodes "
        "(docs/layouts.md)."
    )
    device: Literal["auto", "cpu", "cuda"] = doc(
        "auto", "auto = CUDA + NCCL when GPUs are present, else CPU + gloo."
    )
    nodes: NodesSpec = doc(NodesSpec(), "Elastic node range.")
    nproc_per_node: int = doc(2, "Worker processes per node.")
    max_restarts: int = doc(
        3, "Worker-group restarts each agent allows without progress: a failure counts until the "
        "job completes restart_window more steps. Whatever is left, a crash loop (the same error at "
        "the same step, or as many steps after resuming, twice in a row) or a fatal error stops at once."
    )
    restart_window: int = doc(
        100, "Steps of progress after which a failure no longer counts against max_restarts "
        "(0 = a lifetime budget, as torchrun's --max-restarts)."
    )
    warm_start: bool = doc(
        True, "Fork workers from a per-agent process that already imported torch and the harness "
        "(a restart then starts in milliseconds); false = a fresh interpreter per worker."
    )
    recovery: Literal["in_place", "restart"] = doc(
        "in_place", "How a fault is recovered: in_place = the surviving workers keep their processes "
        "and re-form their process groups (only the lost ranks start anew; needs warm_start); "
        "restart = every worker of the job restarts (forked anew from the zygote)."
    )
    finish_hsdp_step: bool = doc(
        False, "HSDP: a replica (a node) lost in the middle of a step costs the survivors no step: its "
        "replica all-reduce waits for the step's end and each rank keeps its shard-local gradients "
        "before it (docs/in-place.md). Off by default: that all-reduce then no longer overlaps the "
        "backward pass, so measure it on your cluster; off, such a step is redone once after a restore."
    )
    rendezvous: RendezvousSpec = doc(RendezvousSpec(), "How nodes find each other.")
    train: TrainSpec = doc(TrainSpec(), "Steps, batch sizes, seed.")
    optimizer: OptimizerSpec = doc(OptimizerSpec(), "Optimizer and learning-rate schedule.")
    eval: EvalSpec = doc(EvalSpec(), "Periodic evaluation (task path).")
    data: DataSpec = doc(DataSpec(), "Parallel data loading.")
    metrics: MetricsSpec = doc(MetricsSpec(), "Where step metrics go besides events.jsonl.")
    checkpoint: CheckpointSpec = doc(CheckpointSpec(), "Checkpoint policy.")
    timeouts: TimeoutsSpec = doc(TimeoutsSpec(), "Failure-detection timeouts.")
    chaos: list = doc([], "Faults to inject (list of kind/target/at_step/at_seconds).")
    deploy: DeploySpec = doc(DeploySpec(), "Kubernetes deployment: ports, resources, storage.")

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise SpecError("name", f"'{self.name}' must be non-empty [A-Za-z0-9._-]")
        _positive("nproc_per_node", self.nproc_per_node)
        # ddp, fsdp or a mesh, normalized to a plain dict with every dimension (spec.layout)
        object.__setattr__(self, "parallelism", layout.normalize(self.parallelism))
        misfits = layout.fit_problems(self.parallelism, self.nodes.min, self.nodes.max, self.nproc_per_node)
        if misfits:
            raise misfits[0] if len(misfits) == 1 else SpecErrors(misfits)
        _positive("max_restarts", self.max_restarts, allow_zero=True)
        _positive("restart_window", self.restart_window, allow_zero=True)
        most_ranks = layout.dp_degree_at(self.parallelism, self.nodes.max, self.nproc_per_node)
        if self.train.global_batch_size < most_ranks:
            raise SpecError(
                "train.global_batch_size",
                f"{self.train.global_batch_size} is smaller than the largest data-parallel degree "
                f"({most_ranks} at nodes.max): some ranks would get no samples",
                f"raise it to at least {most_ranks}",
            )
        if self.task.target and self.script.path:
            raise SpecError("script.path", "both task.target and script.path are set",
                            "a job trains a task or runs a script: remove one")
        if not self.task.target and not self.script.path:
            raise SpecError("task.target", "the job names no task and no script",
                            "set task.target (e.g. elastic_harness.tasks.mlp:MLPRegression) "
                            "or script.path (your training script)")
