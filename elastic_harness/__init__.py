"""elastic_harness: fault-tolerant elastic training for PyTorch.

Host side (no process group): ``spec`` -> ``launch`` -> ``cluster`` / ``k8s``.
Worker side (one process per rank): ``runtime`` -> ``checkpoint`` / ``data``.
"""

__version__ = "0.1.0"
