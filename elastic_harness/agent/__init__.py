"""The node agent: one process per node, torchelastic's agent with ours changed (``elastic``),
one node's run from start to exit code (``node``), its workers forked from a zygote (``zygote``,
``warm``), kept through a fault in place (``keeper``, ``control``), watched (``watchdog``,
``stall``), reachable (``endpoint``), cut off (``isolation``) and reporting torchelastic's own
events into the run's log (``bridge``) (docs/architecture.md).
"""
