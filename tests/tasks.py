"""Tasks used by tests (importable as ``tests.tasks:NAME``)."""

from elastic_harness.tasks.mlp import MLPRegression


class OtherMLP(MLPRegression):
    """The same shapes as MLPRegression under another name: refused by task identity."""
