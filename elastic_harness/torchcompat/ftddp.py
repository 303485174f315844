"""torchft's private names, for ``bench inflight`` only (torchft is an optional library; the
harness itself never imports it).

``patched_torchft_ddp`` is the one place that reaches into torchft 0.2.0: its
``DistributedDataParallel._comm_hook`` (replaced) and a ``_ManagedFuture``'s ``_fut`` (the
torch future it wraps, which torchft's own hook hands back to the reducer).
"""

from __future__ import annotations

# What the bench's JSON says about the patched side (the private names it relies on).
PRIVATE_NAMES = ("torchft.ddp.DistributedDataParallel._comm_hook", "torchft.manager._ManagedFuture._fut")


def patched_torchft_ddp() -> type:
    """torchft's DDP class with a comm hook that lets backward finish when the gradient
    all-reduce fails.

    torchft 0.2.0's hook waits on the all-reduce; when a peer has died inside the step, the
    wait records the error with the Manager and returns False without chaining a future, and
    the hook's ``assert fut._fut`` then raises inside backward: every healthy replica group
    crashes. The subclass hands the reducer its bucket back instead, so the step goes on to
    ``should_commit()``, which refuses it (the Manager holds the error): the step is thrown
    away and tried again, as torchft's design describes. Needs ``torchft`` (imported here).
    """
    import torch
    from torchft.ddp import DistributedDataParallel

    class SurvivingDDP(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):  # unannotated: torch refuses a hook whose bucket is annotated otherwise
            work = state.allreduce(bucket.buffer())
            ok = work.wait()  # False: the Manager has the error; should_commit() will say no
            fut = work.get_future()
            inner = getattr(fut, "_fut", None)
            if ok:
                return inner if inner is not None else fut  # no inner: the Manager errored before
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    return SurvivingDDP
