"""The agent process: the launch configuration from the spec (``config``, which knows
torchrun's knobs), our rendezvous handler and its rounds, the worker zygote, the watchdog,
the endpoint and a node's isolation (docs/architecture.md).

``env`` is the only module that reads the agent-provided environment of a worker.
"""
