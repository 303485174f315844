"""The one reader of the environment torchelastic gives each worker.

The worker calls ``WorkerEnv.from_environ()`` once at its entry and passes the plain values
down; nothing deeper reads ``os.environ`` or asks torch.distributed for its rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

NODE_VAR = "ELASTIC_HARNESS_NODE"  # set by our agent for its workers


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

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        env = os.environ if environ is None else environ
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise RuntimeError(
                f"worker started without {', '.join(missing)}: it must be launched by the "
                "elastic agent (elastic-harness run/agent), not directly"
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
        )
