"""Forward torchelastic's own events (agent and rendezvous) into the run's events.jsonl.

torchelastic records its events through named logging handlers
(``torch.distributed.elastic.events.handlers``); ``LaunchConfig.event_log_handler`` picks
the one for agent/worker events and rendezvous events always go to "dynamic_rendezvous".
We register a handler under both names: the report can then say when the agent saw a
failure and when the next rendezvous completed, from torchelastic's own account.
"""

from __future__ import annotations

import json
import logging

from elastic_harness.events import EventLog

HANDLER_NAME = "elastic_harness"
# Periodic rendezvous bookkeeping (every keep-alive interval): not events a report needs.
_NOISE = ("_keep_alive", "_DistributedRendezvousOpExecutor.run", "watchdog")


class EventBridge(logging.Handler):
    def __init__(self, events: EventLog, node: str) -> None:
        super().__init__(level=logging.INFO)
        self.events, self.node = events, node

    def emit(self, record: logging.LogRecord) -> None:
        try:
            payload = json.loads(record.getMessage())
        except (ValueError, TypeError):
            return
        if any(noise in payload.get("name", "") for noise in _NOISE):
            return
        f = _fields(payload)
        self.events.emit("torchelastic", node=self.node, name=f["name"], source=f["source"],
                         state=f["state"], message=f["message"], rank=f["rank"])


def _fields(p: dict) -> dict:
    """Keep what a report needs from agent events (``state``) and rdzv events (``message``)."""
    meta = p.get("metadata") or {}
    return {
        "name": p.get("name", ""),
        "source": str(p.get("source", "")),
        "state": meta.get("state", "") or p.get("node_state", ""),
        "message": p.get("message", "") or meta.get("raw_error", "") or "",
        "rank": meta.get("global_rank", p.get("rank")),
    }


def install(events: EventLog, node: str) -> str:
    """Register the bridge; returns the handler name for ``LaunchConfig.event_log_handler``."""
    from elastic_harness.torchcompat.agent import register_event_handler

    bridge = EventBridge(events, node)
    # torchelastic has no public way to add one; where this torch's table cannot be reached,
    # its own "null" destination (no events from torch in events.jsonl).
    if register_event_handler(HANDLER_NAME, bridge) is None:
        return "null"
    register_event_handler("dynamic_rendezvous", bridge)
    return HANDLER_NAME
