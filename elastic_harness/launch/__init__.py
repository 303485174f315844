"""Host side: spec -> torchelastic launch config; the only place that knows torchrun's knobs.

``env`` is the only module that reads the agent-provided environment of a worker.
"""
