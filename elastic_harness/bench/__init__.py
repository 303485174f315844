"""Benchmarks (``elastic-harness bench NAME``): each module exposes ``register(subparsers)``.

They run the harness's real code paths on this machine and print JSON with medians, ratios
and whether each goal was met; timings live here, never in tests.
"""
