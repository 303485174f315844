"""A load planner that never runs code from a checkpoint's shards.

DCP stores every non-tensor value of a state dict (an optimizer's ``param_groups``, a
scheduler's counters, a script's extra state) as a pickled item inside a ``.distcp`` shard,
and torch's ``DefaultLoadPlanner.load_bytes`` reads it back with
``torch.load(weights_only=False)``: anyone who can write a shard, and forge its CRC32 (which
is no authentication: the manifest's signature covers the CRC32 values, and a CRC32 can be
matched by appending four bytes), could run code on resume. Tensors are already read with
``weights_only=True`` by DCP's reader; this planner reads the pickled items the same way, so
a checkpoint holds tensors and plain Python values only (dicts, lists, tuples, numbers,
strings, ``torch`` dtypes and sizes, and whatever the user allowed with
``torch.serialization.add_safe_globals``).

It also lets a checkpoint lack the ``optional`` keys it is given (fields added to the saved
state later, whose value in the state being loaded into is what an older checkpoint meant):
those keep their value; any other missing key is refused as DCP refuses it.

Call order: ``WeightsOnlyLoadPlanner(optional)`` per ``dcp.load`` (it holds that load's state
dict).
"""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from elastic_harness.errors import CheckpointError


def refusal(detail: str) -> str:
    """Pure: the line of a ``weights_only`` failure that says what was refused (torch's
    message runs to paragraphs; the reason follows its ``WeightsUnpickler error:``)."""
    rest = detail.split("WeightsUnpickler error:", 1)[-1]
    lines = [line.strip() for line in rest.splitlines() if line.strip()] or ["unreadable"]
    return lines[0][:200]


def load_item(fqn: str, value: io.BytesIO) -> object:
    """One pickled state-dict item, read with ``weights_only=True``; a refused one is a
    ``CheckpointError`` naming the item and the fix."""
    try:
        return torch.load(value, weights_only=True)
    except Exception as e:  # noqa: BLE001 - UnpicklingError, or a damaged item's RuntimeError
        raise CheckpointError(
            f"checkpoint item '{fqn}' is not plain data, which a weights-only load refuses ({refusal(str(e))})",
            "register state whose state_dict() holds tensors and plain Python values, or allow the "
            "class with torch.serialization.add_safe_globals([...]) before run.resume()") from None


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    def __init__(self, optional: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.optional = optional

    def create_local_plan(self):  # noqa: ANN201 - torch's LoadPlan
        absent = set(self.state_dict) - set(self.metadata.state_dict_metadata)
        if absent and absent <= self.optional:
            self.allow_partial_load = True  # only these may be absent: checked just above
        return super().create_local_plan()

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load_item(fqn, value)
        if self.flatten_state_dict:
            set_at(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def set_at(root: object, path: tuple, value: object) -> None:
    """Put ``value`` at ``path`` (DCP's flattening path: dict keys and list indices) inside
    ``root``, the nested state being loaded into, which holds every container on the way
    (the plan was made from it)."""
    container = root
    for key in path[:-1]:
        container = container[key]
    container[path[-1]] = value
