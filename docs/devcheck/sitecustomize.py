# Device check only (never shipped): the GPU image has torch 2.11+cu130, and the harness
# refuses any torch but 2.13.0 before patching torch's private functions. Let it try on the
# installed release so the CUDA/NCCL paths can be exercised; the check reports the version.
import importlib.metadata

try:
    import elastic_harness.deps as _deps

    _deps.TORCH_VERSION = importlib.metadata.version("torch").split("+", 1)[0]
except Exception:  # noqa: BLE001
    pass
