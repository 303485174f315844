"""``bench recovery`` and ``bench buddy``: how fast a job recovers from faults, and what the
in-memory tier's buddy copies cost a step.

``main`` is ``bench recovery`` (worker crashes, goodput, the tier's cost, and the rows of
``nodeloss`` and ``resize``); ``nodeloss``: node failures as clusters have them (kill, freeze,
spares, N nodes, the soak with ``soak_script``); ``resize``: nodes joining (scale-up, churn);
``launching``: the job and processes the recovery rows start; ``crash_stats``, ``join_stats``
and ``startup_stats``: pure figures from a run's events. ``buddy`` is ``bench buddy``: one
process pair, the per-step cost of snapshots and buddy copies.
"""
