"""Staging for async saves: copy the state into host buffers allocated once and reused.

``dcp.async_save`` returns to training as soon as its stager has made a copy of the state
that later optimizer steps cannot change. Torch's default stager deep-copies the state
dict on every save (about 1 ms of Python per DTensor here, twice the memcpy itself for a
64 MB FSDP state). This one walks the state, copies each tensor into a buffer kept from the
previous save under the same key (same shape and dtype, else a new one), and rebuilds
DTensors around their buffers (kept too, while mesh and layout stay the same). Buffers are pinned when CUDA is present, and device-to-host
copies are issued non-blocking and synchronised once at the end.

Tensors another rank writes (``skip``: their fully qualified names, as DCP flattens them;
see ``plans.written_elsewhere``) are not copied: the staged state holds a ``meta`` tensor of
their shape, which plans like the tensor and has no bytes to write (a buffer kept for one
from an earlier save is released).

Limits: tensor subclasses other than DTensor, and objects that are neither tensors,
containers nor immutable scalars, are deep-copied (correct, not fast). At most one save
may use the buffers at a time: the saver waits for the previous save before staging.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

_IMMUTABLE = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


class ReusedBufferStager(AsyncStager):
    """An ``AsyncStager`` that stages synchronously into reused host buffers."""

    _synchronize_after_execute = False  # stage() returns only when the copy is complete

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._wrapped: dict[tuple, tuple[tuple, DTensor]] = {}  # DTensors around the buffers
        self._skip: frozenset[str] = frozenset()
        self.copied = 0  # bytes the last ``stage`` copied
        self._copied_from_device = False

    def stage(self, state_dict: dict[str, Any], skip: frozenset[str] = frozenset()) -> dict[str, Any]:
        self._copied_from_device = False
        self._skip, self.copied = skip, 0
        staged = self._copy(state_dict, ())
        if self._copied_from_device:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` is synchronous."""

    def close(self) -> None:
        self._buffers.clear()
        self._wrapped.clear()

    def _copy(self, obj: Any, path: tuple) -> Any:
        if isinstance(obj, DTensor):
            local = self._into(path, obj.to_local())
            spec = (obj.device_mesh, tuple(obj.placements), obj.shape, obj.stride())
            cached = self._wrapped.get(path)
            if cached is None or cached[1].to_local() is not local or cached[0] != spec:
                wrapped = DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                             shape=obj.shape, stride=obj.stride())
                cached = self._wrapped[path] = (spec, wrapped)
            return cached[1]
        if type(obj) is torch.Tensor or isinstance(obj, torch.nn.Parameter):
            if self._skip and ".".join(map(str, path)) in self._skip:
                return self._placeholder(path, obj)
            return self._into(path, obj)
        if isinstance(obj, dict):
            return type(obj)((k, self._copy(v, (*path, k))) for k, v in obj.items())
        if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
            return type(obj)(self._copy(v, (*path, i)) for i, v in enumerate(obj))
        if isinstance(obj, _IMMUTABLE):
            return obj
        return copy.deepcopy(obj)

    def _placeholder(self, path: tuple, src: torch.Tensor) -> torch.Tensor:
        self._buffers.pop(path, None)
        return torch.empty(src.shape, dtype=src.dtype, device="meta")

    def _into(self, path: tuple, src: torch.Tensor) -> torch.Tensor:
        src = src.detach()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu",
                              pin_memory=self.pin_memory and src.device.type == "cuda")
            self._buffers[path] = buf
        non_blocking = src.device.type == "cuda" and buf.is_pinned()
        self._copied_from_device |= src.device.type == "cuda"
        buf.copy_(src, non_blocking=non_blocking)
        self.copied += buf.nbytes
        return buf
