"""How a node and its workers are launched, decided before anything runs: torchelastic's launch
configuration from the spec and the node's options (``config``: flags, ``PET_*`` variables,
Slurm's defaults through ``slurm_env``), where a run's scratch files go and the environment torch
is given (``scratch``), when an agent stops restarting its workers (``policy``), and the variables
a worker is started with (``env``, their one reader, imported by the worker side).
The agent that uses them is ``agent/``, its rendezvous ``rendezvous/`` (docs/architecture.md).
"""
