"""What happened in a run, from its ``events.jsonl``: per-fault recovery and goodput.

``timeline`` is pure (events in, dataclasses out); ``plot`` draws ``report.png``.
"""
