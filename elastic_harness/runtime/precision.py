"""Mixed precision: which autocast to use, and the GradScaler fp16 needs.

- ``fp32``: no autocast.
- ``bf16``: autocast to bfloat16 on CPU or CUDA (a GPU without bf16 support is refused).
  Parameters, gradients and optimizer state stay in their own dtype (fp32 for most models),
  so a bf16 run resumes exactly like an fp32 run.
- ``fp16``: autocast to float16 on CUDA only, with a ``torch.amp.GradScaler`` whose state
  (scale, growth tracker) is part of the checkpoint.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from elastic_harness.errors import HarnessError

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check(precision: str, device: torch.device) -> None:
    """Refuse a precision this device cannot run, with the fix."""
    if precision == "fp16" and device.type != "cuda":
        raise HarnessError(
            f"train.precision: fp16 needs a CUDA device; this worker runs on {device.type}",
            "use train.precision: bf16 on CPU (or fp32)",
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise HarnessError(
            f"train.precision: bf16 is not supported by this GPU ({name})",
            "use train.precision: fp16 (with its GradScaler) or fp32",
        )


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context to run forward and loss under (a no-op for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> Any:
    """A GradScaler for fp16 (checkpointed with the state), else None."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)
