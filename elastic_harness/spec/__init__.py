"""Pure job spec: YAML -> frozen, validated ``JobSpec``. Imports only ``errors``."""

from elastic_harness.spec.loader import (
    SpecErrors,
    describe,
    dump_job,
    load_job,
    parse_job,
    script_job,
)
from elastic_harness.spec.schema import (
    CheckpointSpec,
    DataSpec,
    DeploySpec,
    EvalSpec,
    FaultSpec,
    JobSpec,
    MetricsSpec,
    NodesSpec,
    OptimizerSpec,
    RendezvousSpec,
    ScriptSpec,
    TaskSpec,
    TimeoutsSpec,
    TrainSpec,
)

__all__ = [
    "CheckpointSpec",
    "DataSpec",
    "DeploySpec",
    "EvalSpec",
    "FaultSpec",
    "JobSpec",
    "MetricsSpec",
    "NodesSpec",
    "OptimizerSpec",
    "RendezvousSpec",
    "ScriptSpec",
    "SpecErrors",
    "TaskSpec",
    "TimeoutsSpec",
    "TrainSpec",
    "describe",
    "dump_job",
    "load_job",
    "parse_job",
    "script_job",
]
