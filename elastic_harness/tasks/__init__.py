"""The user's model, data and loss, behind a small interface (``Task``)."""

from elastic_harness.tasks.base import Task, load_task

__all__ = ["Task", "load_task"]
