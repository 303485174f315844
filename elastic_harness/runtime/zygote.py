"""The worker zygote: one process per agent that imports torch and the harness once, then
forks a fresh worker for each request (``agent.warm`` is the agent's side).

A worker started this way skips the interpreter start and ``import torch`` (seconds on a
small machine): the fork is ready in milliseconds. The zygote itself never trains, so
every worker is a fork of the same pristine process; a worker that corrupted its own
state is replaced by a new fork, never by a copy of itself.

Lifetime: the zygote arms ``PR_SET_PDEATHSIG`` against its agent first thing, and each
worker against the zygote, so killing an agent (even with SIGKILL) takes its zygote and
workers with it. The zygote also exits when the agent closes its socket. It runs in a
session of its own and each worker in another (as torchelastic starts workers), so a signal
to the agent's process group reaches workers only as the agent forwards it. Nothing is
written to the file system: the agent talks to it over an inherited socket pair.

Protocol (one JSON object per ``SOCK_SEQPACKET`` message), requests from the agent:
  ``{"op": "spawn", "module", "argv", "env", "cwd", "stdout", "stderr", "unbuffered"}``
      -> ``{"op": "spawned", "pid"}`` (or ``{"op": "error", "message"}``); a descriptor
      passed with it (``SCM_RIGHTS``) is the worker's end of its agent's control channel:
      the worker inherits it, named by ``CONTROL_FD_VAR``, and the zygote closes its copy
  ``{"op": "signal", "pid", "sig"}``: sent only while ``pid`` is an unreaped child, so a
      recycled pid is never signalled; no reply.
  ``{"op": "preload", "modules", "env"}``: import more now, with ``env`` added to this
      process's environment first (``AFTER_RUN_DIR``); no reply.
and unprompted: ``{"op": "ready", "threads"}`` once the imports are done, and
``{"op": "exit", "pid", "code"}`` when a worker ends (``code`` as ``Popen.returncode``:
negative for a signal).

Usage (by the agent): ``python -m elastic_harness.runtime.zygote FD AGENT_PID [--preload
MODULE,...] [--also MODULE,...]`` (default: ``PRELOAD``; tests preload nothing; ``--also``:
more on top, as the host's zygote of a local run does for its agents).

The same process serves ``run`` on one machine as the *host's* zygote: it forks each
simulated node's agent (``python -m elastic_harness agent ...`` in the fork, ``"append"``:
onto the node's log). A request with ``"zygote": true`` also gives the new process its own
worker zygote, forked from it at once (``fork_worker_zygote``): torch is imported already
and no thread runs yet, so neither the agent nor its zygote pays an interpreter start and
``import torch`` (seconds of CPU each). The agent adopts it (``agent.zygote``) through
``ZYGOTE_VAR``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys

from elastic_harness.launch.env import ZYGOTE_VAR  # torch-free
from elastic_harness.torchcompat.modules import DYNAMO  # torch-free

# What every worker imports before its first step; the user's task or script modules are
# not imported here (their import may start threads, which must not be forked).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.nn.parallel",
    DYNAMO,  # DDP and FSDP import it when they wrap a model: seconds
    "torch.utils.tensorboard",
    "numpy",
    "numpy.random",
    "yaml",
    "elastic_harness.runtime.worker",
    # not elastic_harness.runtime.entry: each fork runs it as __main__ (``run_module``), and
    # runpy warns in every worker's stderr (RuntimeWarning: found in sys.modules ... prior to
    # execution) when it was imported already, then executes it a second time. It imports
    # nothing heavy of its own.
    "elastic_harness.memtier.tier",
    "encodings.idna",  # the first host name lookup (the store, gloo) imports this codec
)
# What a host's zygote imports only once the run directory is known (``"preload"``):
# torch._dynamo makes torch's compile cache directory as it is imported, in the temp dir
# unless ``TORCHINDUCTOR_CACHE_DIR`` names the run dir's (``launch.scratch``).
AFTER_RUN_DIR = (DYNAMO,)
MAX_MESSAGE = 1 << 20
CONTROL_FD_VAR = "ELASTIC_HARNESS_CONTROL_FD"  # the worker's end of its control channel (runtime.control)


# Signals the zygote ignores (its workers get the defaults back): ^C is the agent's to handle
# and forward, and a scheduler that signals every process of a job step (Slurm's scancel
# --signal, proctrack/linuxproc) must not end the zygote before the workers' drain: the
# zygote goes when its agent does (PR_SET_PDEATHSIG, or the agent closing its socket).
SHIELDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def die_with_parent(expected_parent: int) -> None:
    """SIGKILL this process when its parent dies; exit now if that already happened."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != expected_parent:  # the parent died before the signal was armed
        os._exit(1)


# Preloaded only where the extra that provides it is installed (the core install lacks it).
OPTIONAL = {"torch.utils.tensorboard": "tensorboard", DYNAMO: DYNAMO}  # DYNAMO: private to torch
TENSORBOARD = "torch.utils.tensorboard"


def preload_for(*, tensorboard: bool) -> tuple[str, ...]:
    """Pure: ``PRELOAD`` less what this job's workers never import: TensorBoard's writer
    unless the job writes TensorBoard files (``metrics.tensorboard``); a quarter second of
    CPU per zygote, paid by every node's start-up on a busy machine."""
    return PRELOAD if tensorboard else tuple(m for m in PRELOAD if m != TENSORBOARD)


# What this process preloaded so far (``preload``): a worker zygote forked from it
# (``fork_worker_zygote``) has these already and imports nothing more.
PRELOADED: list[str] = []


def preload(modules: tuple[str, ...] = PRELOAD) -> int:
    """Import what workers need; the number of threads this process then runs."""
    import importlib

    from elastic_harness.deps import has_module

    for name in modules:
        if name in OPTIONAL and not has_module(OPTIONAL[name]):
            continue
        importlib.import_module(name)
        PRELOADED.append(name)
    loader = sys.modules.get("elastic_harness.spec.loader")
    if loader is not None:  # every worker reads its job: the schema's types, resolved once here
        loader.prepare()
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def serve(sock) -> None:
    """Answer requests until the agent closes the socket."""
    import selectors

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd is written
    signal.set_wakeup_fd(wake_w)
    children: set[int] = set()
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ)
        sel.register(wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in sel.select():
                if key.fileobj == wake_r:
                    _drain(wake_r)
                    _reap(sock, children)
                    continue
                data, fds = _receive(sock)
                if not data:
                    return  # the agent is gone or done
                try:
                    _handle(sock, json.loads(data), children, (wake_r, wake_w), fds)
                finally:
                    for fd in fds:
                        os.close(fd)


def _receive(sock) -> tuple[bytes, list[int]]:
    """One request and the descriptors passed with it (at most one: a control channel)."""
    import socket

    try:
        data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
    except OSError:
        return b"", []
    return data, list(fds)


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _reap(sock, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send(sock, {"op": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)})


def _handle(sock, msg: dict, children: set[int], private_fds: tuple[int, int], passed: list[int]) -> None:
    if msg["op"] == "signal":
        if msg["pid"] in children:  # not reaped yet, so the pid is still that worker's
            with contextlib.suppress(ProcessLookupError):
                os.kill(msg["pid"], msg["sig"])
        return
    if msg["op"] == "preload":
        os.environ.update(msg.get("env") or {})
        preload(tuple(msg["modules"]))
        return
    if msg["op"] != "spawn":
        _send(sock, {"op": "error", "message": f"unknown request {msg['op']!r}"})
        return
    parent = os.getpid()

    def child(mask: set) -> int:
        sock.close()
        for fd in private_fds:
            os.close(fd)
        return become_worker(msg, parent, mask, passed)

    pid = fork_shielded(child)
    children.add(pid)
    _send(sock, {"op": "spawned", "pid": pid})


def fork_shielded(child) -> int:
    """Fork; the child runs ``child(mask)`` and exits with its code; the child's pid.
    ``SHIELDED`` is blocked across the fork: a signal sent to the new process before it has
    reset the zygote's SIG_IGN (an agent stopping a group it just started) stays pending and
    is delivered once the default disposition is back, instead of being ignored; ``mask`` is
    the mask to restore then."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = child(mask)
        finally:
            os._exit(code)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return pid


def _send(sock, msg: dict) -> None:
    with contextlib.suppress(OSError):  # the agent is gone; the next recv says so
        sock.send(json.dumps(msg).encode())


def become_worker(msg: dict, zygote: int, mask: set, passed: list[int] = ()) -> int:
    """In the fresh fork: the environment and streams of a worker, then run its module as
    ``python -m MODULE ARGV`` would. Returns the exit code (the caller ``_exit``s with it).
    ``mask``: the signal mask to restore once the default dispositions are back; ``passed``:
    the control channel's descriptor, if the agent sent one."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, *SHIELDED):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a pending SIGTERM lands now
    os.setsid()  # its own session, as torchelastic starts workers
    die_with_parent(zygote)
    os.chdir(msg["cwd"])
    os.environ.clear()
    os.environ.update(msg["env"])
    if passed:
        os.environ[CONTROL_FD_VAR] = str(passed[0])
    append = bool(msg.get("append"))
    _redirect(1, msg.get("stdout"), append)
    _redirect(2, msg.get("stderr"), append)
    if msg.get("unbuffered"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    if msg.get("zygote"):
        fork_worker_zygote()
    return run_module(msg["module"], msg["argv"])


def _redirect(fd: int, path: str | None, append: bool = False) -> None:
    """``fd`` onto ``path``: truncated, or appended to (two descriptors on one file, stdout
    and stderr, then interleave whole writes instead of overwriting each other)."""
    if not path:
        return
    target = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
    os.dup2(target, fd)
    os.close(target)


def fork_worker_zygote() -> int:
    """In a fresh fork about to run an agent: fork that agent's worker zygote from it now,
    while it runs one thread and has torch imported (module doc). The zygote's end of their
    socket and its pid are named by ``ZYGOTE_VAR`` (``FD,PID``) for the agent to adopt; the
    zygote's pid."""
    import socket

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    agent = os.getpid()

    def child(mask: set) -> int:
        ours.close()
        os.setsid()  # its own session, as the agent's ``Popen`` would start it
        return serve_as_zygote(theirs, agent, tuple(PRELOADED), mask=mask)

    pid = fork_shielded(child)
    theirs.close()
    os.environ[ZYGOTE_VAR] = f"{ours.detach()},{pid}"
    return pid


def run_module(module: str, argv: list[str]) -> int:
    """``python -m module argv`` in this process: exit code as the interpreter would give it,
    after the ``atexit`` handlers (``os._exit`` follows, which would skip them)."""
    import runpy
    import traceback

    from elastic_harness.procexit import run_exit_callbacks

    sys.argv = [module, *argv]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:  # what the interpreter prints for an uncaught exception
        traceback.print_exc()
        code = 1
    finally:
        run_exit_callbacks()  # the interpreter's own exit step, less torch's teardown
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    return code


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def serve_as_zygote(sock, agent: int, modules: tuple[str, ...], mask: set | None = None) -> int:
    """Be ``agent``'s zygote on ``sock``: import ``modules``, say ready, serve until the
    agent is gone. ``mask``: the signal mask to restore once the shielded signals are
    ignored (a fork that blocked them across ``fork``)."""
    die_with_parent(agent)
    for sig in SHIELDED:
        signal.signal(sig, signal.SIG_IGN)
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    threads = preload(modules)
    _send(sock, {"op": "ready", "threads": threads})
    serve(sock)
    return 0


def parse_modules(argv: list[str]) -> tuple[str, ...]:
    """Pure: the modules ``main``'s flags name (``--preload`` replaces ``PRELOAD``,
    ``--also`` adds to it)."""
    flags = dict(zip(argv[::2], argv[1::2], strict=True))
    names = lambda key: tuple(m for m in flags.get(key, "").split(",") if m)  # noqa: E731
    return (names("--preload") if "--preload" in flags else PRELOAD) + names("--also")


def main(argv: list[str]) -> int:
    import socket

    fd, agent = int(argv[0]), int(argv[1])
    return serve_as_zygote(socket.socket(fileno=fd), agent, parse_modules(argv[2:]))


if __name__ == "__main__":
    from elastic_harness.procexit import exit_without_teardown

    # Every run's shutdown waits for the agent to reap its zygote: no second of teardown.
    exit_without_teardown(main(sys.argv[1:]))
