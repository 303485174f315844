"""``bench inflight``: a node lost mid-training, the harness beside torchft 0.2.0.

``main`` runs both sides and judges the goals; ``job`` is the job they share;
``harness_side`` runs and reads the harness; ``torchft_run`` (the lighthouse and replica
group processes), ``torchft_worker`` (one replica group) and ``torchft_stats`` (its figures)
are torchft's side. torchft's private names are in ``torchcompat.ftddp``.
"""
