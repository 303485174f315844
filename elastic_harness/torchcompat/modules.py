"""Private torch modules the harness imports by name (torch-free: the zygote's preload list
reads it before torch is imported). Each is skipped where this torch has no such module."""

from __future__ import annotations

DYNAMO = "torch._dynamo"  # DDP and FSDP import it when they wrap a model: seconds, paid once in the zygote
