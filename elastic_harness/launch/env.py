"""The one reader of the environment a worker is started with.

A worker calls ``WorkerEnv.from_environ()`` once at its entry and passes the plain values
down; nothing deeper reads ``os.environ`` or asks torch.distributed for its rank.

Three ways a worker starts, all read here:

- by our agent (``elastic-harness run`` / ``agent``): torchelastic's variables, plus
  ``ELASTIC_HARNESS_JOB`` / ``ELASTIC_HARNESS_RUN_DIR`` naming the resolved job and run dir;
- by plain ``torchrun`` running a user's script: torchelastic's variables only (the script
  names its job and run dir in ``elastic_harness.init``);
- as a plain ``python script.py``: no variables at all; a world of one process.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from elastic_harness.jobkey import KEY_FILE_VAR  # the job's key, when not the run dir's

NODE_VAR = "ELASTIC_HARNESS_NODE"  # set by our agent for its workers
JOB_VAR = "ELASTIC_HARNESS_JOB"  # the resolved job YAML (set by our agent)
RUN_DIR_VAR = "ELASTIC_HARNESS_RUN_DIR"  # the run directory (set by our agent)
AGENT_PID_VAR = "ELASTIC_HARNESS_AGENT_PID"  # our agent's pid (a worker's parent may be its zygote)
# An agent forked by its host's zygote: the worker zygote forked with it, ``FD,PID``
# (``runtime.zygote.fork_worker_zygote``), adopted by ``agent.zygote``.
ZYGOTE_VAR = "ELASTIC_HARNESS_ZYGOTE"
MEMORY_VAR = "ELASTIC_HARNESS_MEMORY"  # the agent's in-memory checkpoint slots (memtier.host)
# The variables torchelastic sets for each worker it starts: in place (``runtime.inplace``) a
# kept worker takes these from its agent's reform order; the agent's own stay as they were.
WORKER_VARS = ("RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
               "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
               "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
               "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_TIMER_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
# The agent's "drain, a node joins" to its workers (``agent.elastic``; ``runtime.session.Drain``):
# a drain that may keep the state in memory, unlike SIGTERM's stop.
JOIN_SIGNAL = signal.SIGUSR1


@dataclass(frozen=True)
class WorkerEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int  # this node's index in the current rendezvous
    restart_count: int  # worker-group restarts this agent has done so far
    max_restarts: int
    run_id: str
    master_addr: str
    master_port: int
    node: str = ""  # the agent's node name (``--node``), for node-targeted faults
    timer_file: str = ""  # the agent's watchdog FIFO (torchelastic's FileTimerServer)
    job_path: str = ""  # the resolved job, when our agent started this worker
    run_dir: str = ""  # the run directory, when our agent started this worker
    launched: bool = True  # False: a plain `python script.py`, no launcher at all
    agent_store: bool = False  # MASTER_PORT is the agent's shared rendezvous store
    agent_pid: int = 0  # the elastic agent's pid when ours started this worker, else 0
    memory: str = ""  # the agent's in-memory checkpoint slots, as ``memtier.host`` describes them
    key_file: str = ""  # the job's key when provided from outside (``jobkey``), else the run dir's
    group_world_size: int = 0  # nodes in the current rendezvous (torchelastic's); 0 = not said

    @property
    def by_harness(self) -> bool:
        """Started by our agent (which names the job), not by plain torchrun or python."""
        return bool(self.job_path)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None,
                     standalone_ok: bool = False) -> WorkerEnv:
        env = os.environ if environ is None else environ
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing and standalone_ok and len(missing) == 4:
            return cls(rank=0, world_size=1, local_rank=0, local_world_size=1, group_rank=0,
                       restart_count=0, max_restarts=0, run_id="", master_addr="",
                       master_port=0, launched=False, group_world_size=1)
        if missing:
            raise RuntimeError(
                f"worker started without {', '.join(missing)}: it must be launched by the "
                "elastic agent (elastic-harness run/agent, or torchrun), not directly"
            )
        return cls(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
            group_rank=int(env.get("GROUP_RANK", "0")),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")),
            run_id=env.get("TORCHELASTIC_RUN_ID", ""),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]),
            node=env.get(NODE_VAR, ""),
            timer_file=env.get("TORCHELASTIC_TIMER_FILE", ""),
            job_path=env.get(JOB_VAR, ""),
            run_dir=env.get(RUN_DIR_VAR, ""),
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True",
            agent_pid=int(env.get(AGENT_PID_VAR, "0") or 0),
            memory=env.get(MEMORY_VAR, ""),
            key_file=env.get(KEY_FILE_VAR, ""),
            group_world_size=int(env.get("GROUP_WORLD_SIZE", "0") or 0),
        )
