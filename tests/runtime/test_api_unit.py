"""The bring-your-own-training pieces that need no process group: decisions and checks."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
from torch import nn

from elastic_harness.data.sampler import EpochOrder, micro_batches, step_plan
from elastic_harness.errors import CheckpointError, HarnessError, UsageError
from elastic_harness.launch.policy import stop_reason
from elastic_harness.runtime import failures, precision
from elastic_harness.runtime.digest import model_digest, tensor_bytes
from elastic_harness.runtime.evaluate import eval_batches
from elastic_harness.runtime.loader import LoaderSettings, StepLoader, planner
from elastic_harness.runtime.session import check_registration

pytestmark = pytest.mark.timeout(120)


# ----- crash loops ---------------------------------------------------------------------
def failure(restart, sig="abc", step=7, node="n0", t=10.0, **kw):
    return {"event": "failure", "t": t, "node": node, "restart": restart, "signature": sig,
            "step": step, "message": "RuntimeError: boom", "where": "train.py:3", **kw}


def test_same_error_at_same_step_twice_is_a_crash_loop():
    reason = stop_reason([failure(0), failure(1)], "n0", since=0.0)
    assert reason and "crash loop" in reason and "step 7" in reason and "train.py:3" in reason


@pytest.mark.parametrize("events", [
    [failure(0)],                                        # one attempt: bad luck, maybe
    [failure(0), failure(1, step=9)],                    # another step: progress was made
    [failure(0, resumed_at=0), failure(1, step=9, resumed_at=5)],  # and another distance from its resume
    [failure(0), failure(1, sig="other")],               # another error
    [failure(0), failure(2)],                            # not consecutive attempts
    [failure(0, node="n1"), failure(1, node="n1")],      # another node's attempts
    [failure(0, t=1.0), failure(1, t=2.0)],              # before this agent started
    [{"event": "failure", "t": 10.0, "node": "n0", "restart": r, "step": 7} for r in (0, 1)],  # SIGKILL-like
])
def test_anything_else_is_not(events):
    assert stop_reason(events, "n0", since=5.0) is None


def test_the_same_error_the_same_steps_after_each_resume_is_a_crash_loop():
    """The in-memory tier resumes each attempt where the last one failed: a bug in evaluation
    then fails one step later each time, always in the first step after the resume."""
    reason = stop_reason([failure(0, step=1, resumed_at=0), failure(1, step=2, resumed_at=1)], "n0", since=0.0)
    assert reason and "crash loop" in reason and "1 step(s) after resuming" in reason


@pytest.mark.parametrize("step, resumed, says, never", [
    (0, None, "before training started", "resuming"),            # failed building its data
    (0, 0, "in the first step, each time starting fresh (there was no checkpoint", "after resuming"),
    (7, 0, "at step 7, each time starting fresh", "after resuming"),
    (7, 5, "at step 7, each time after resuming from step 5", "fresh"),
])
def test_a_crash_loop_names_only_the_start_each_attempt_had(step, resumed, says, never):
    """Issue 33: a crash loop at step 0 said "after resuming from the same checkpoint" when
    there was none."""
    events = [failure(r, step=step, **({} if resumed is None else {"resumed_at": resumed})) for r in (0, 1)]
    reason = stop_reason(events, "n0", since=0.0)
    assert reason and says in reason and never not in reason, reason
    assert "same checkpoint" not in reason


def test_the_agent_judges_the_failures_logged_since_it_started(tmp_path):
    from elastic_harness.agent.node import Witness
    from elastic_harness.events import EventLog

    log = EventLog(tmp_path / "events.jsonl")
    log.emit("failure", node="n0", restart=0, signature="abc", step=7, message="old run")  # before the agent
    judge = Witness(tmp_path / "events.jsonl", "n0", since=0.0).judge
    log.emit("step", step=7, message="a failure")  # not a failure event, though the bytes say so
    log.emit("failure", node="n0", restart=0, signature="abc", step=7, message="RuntimeError: boom")
    assert judge() is None  # one attempt
    log.emit("failure", node="n0", restart=1, signature="abc", step=7, message="RuntimeError: boom")
    assert "crash loop" in judge()


def test_a_fatal_error_stops_at_once():
    fatal = {"event": "failure", "t": 10.0, "node": "n0", "fatal": True, "message": "incompatible"}
    assert stop_reason([fatal], "n0", since=0.0) == "incompatible"


def test_failure_signature_is_stable_and_distinguishes():
    def boom(msg):
        try:
            raise ValueError(msg)
        except ValueError as e:
            return failures.describe(e)

    a, b, c = boom("x at 1"), boom("x at 1"), boom("y")
    assert a["signature"] == b["signature"] != c["signature"]
    assert a["message"] == "ValueError: x at 1" and "test_api_unit.py" in a["where"]


# ----- what a step uses ----------------------------------------------------------------
def test_step_plan_covers_the_step_once_with_positions():
    order = EpochOrder(0, 50)
    plans = [step_plan(order, 40, 12, 3, r, 3) for r in range(3)]
    pairs = [p for plan in plans for chunk in plan for p in chunk]
    assert [pos for pos, _ in pairs] == list(range(40, 52))  # straddles the epoch boundary
    assert [idx for _, idx in pairs] == order.indices(40, 52)
    assert len({len(plan) for plan in plans}) == 1  # same micro-batch count on every rank


def test_no_rank_gets_an_empty_micro_batch():
    # 3 samples over 2 ranks with micro-batch 1: the smaller share has one sample, so one
    # micro-batch each (an empty one would skip a forward its FSDP peers wait on).
    assert micro_batches(3, 2, 1) == 1
    assert micro_batches(30, 4, 8) == 1 and micro_batches(30, 2, 8) == 2


def test_eval_split_is_exact_and_balanced():
    parts = [eval_batches(10, 3, r, 3) for r in range(3)]
    assert sorted(i for p in parts for b in p for i in b) == list(range(10))
    assert len({len(p) for p in parts}) == 1 and all(b for p in parts for b in p)
    with pytest.raises(HarnessError, match="fewer than the 3 ranks"):
        eval_batches(2, 3, 0, 4)


class Noisy(torch.utils.data.Dataset):
    """Items with randomness in __getitem__ (augmentation)."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.tensor([float(i)]) + torch.rand(1)


@pytest.mark.parametrize("workers", [0, 2])
def test_loaded_batches_do_not_depend_on_loader_processes_or_resume_point(workers):
    plan_of = planner(EpochOrder(3, 40), 0, 0, 8, 2, 1, 2)
    kw = dict(seed=3, device=torch.device("cpu"), collate=None, prefetch=2, pin_memory=False)
    reference = StepLoader(Noisy(), plan_of, 0, 6, LoaderSettings(workers=0, **kw))
    want = [reference.next_step() for _ in range(6)]
    resumed = StepLoader(Noisy(), plan_of, 2, 6, LoaderSettings(workers=workers, **kw))  # a restart at step 2
    got = [resumed.next_step() for _ in range(4)]
    resumed.close()
    for (plan_a, batches_a), (plan_b, batches_b) in zip(want[2:], got, strict=True):
        assert plan_a == plan_b
        assert all(torch.equal(a, b) for a, b in zip(batches_a, batches_b, strict=True))


# ----- state ---------------------------------------------------------------------------
def test_digest_covers_any_dtype_and_0dim_buffers(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # bf16 ops: not /tmp
    bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).to(torch.bfloat16)
    before = model_digest(bn)
    assert model_digest(bn) == before
    bn[1].num_batches_tracked += 1  # 0-dim int64: used to crash the digest
    assert model_digest(bn) != before
    assert tensor_bytes("b", torch.tensor(True)).endswith(b"\x01")


def _model_and_optim():
    model = nn.Linear(2, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_registration_refuses_an_optimizer_over_other_parameters():
    model, _ = _model_and_optim()
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(UsageError, match="not parameters of the registered model"):
        check_registration(model, other, None, {})


def test_registration_refuses_a_scheduler_whose_state_cannot_be_saved():
    model, optim = _model_and_optim()

    class Holder:
        def __init__(self):
            self.fn = lambda step: 1.0  # a lambda inside the state: cannot be pickled

        def state_dict(self):
            return {"fn": self.fn}

        def load_state_dict(self, sd):
            pass

    with pytest.raises(UsageError, match="cannot be saved"):
        check_registration(model, optim, None, {"schedule": Holder()})
    foreign = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1), 2)
    with pytest.raises(UsageError, match="another optimizer"):
        check_registration(model, optim, foreign, {})
    ok = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)  # functions are not saved: fine
    check_registration(model, optim, ok, {})
    pickle.dumps(ok.state_dict())


def test_precision_refused_where_it_cannot_run():
    with pytest.raises(HarnessError, match="fp16 needs a CUDA device"):
        precision.check("fp16", torch.device("cpu"))
    precision.check("bf16", torch.device("cpu"))
    assert precision.grad_scaler("fp32", torch.device("cpu")) is None


def test_checkpoint_entries_must_match_the_job():
    from elastic_harness.checkpoint.compat import _check_entries

    _check_entries("ckpt", {"model", "optim", "train"}, {"model", "optim", "train"})
    with pytest.raises(CheckpointError, match="has no sched state"):
        _check_entries("ckpt", {"model", "optim", "train"}, {"model", "optim", "train", "sched"})
    with pytest.raises(CheckpointError, match="holds scaler state"):
        _check_entries("ckpt", {"model", "optim", "train", "scaler"}, {"model", "optim", "train"})


# ----- the agent -------------------------------------------------------------------------
def test_agent_health_verdicts():
    from elastic_harness.launch.policy import agent_health

    assert agent_health("HEALTHY", 0.5, 60)[0]
    assert agent_health("INIT", 50, 60)[0]  # a rendezvous under way, within the bound
    assert agent_health("FAILED", 0.1, 60) == (False, "worker group failed")
    ok, why = agent_health("HEALTHY", 61, 60)
    assert not ok and "silent for 61s" in why


def no_rendezvous():
    """A rendezvous handler for an agent that never joins one (its other parts are tested)."""
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    class NoRendezvous(RendezvousHandler):
        def get_backend(self): return "none"
        def next_rendezvous(self): raise AssertionError("not used")
        def is_closed(self): return False
        def set_closed(self): pass
        def num_nodes_waiting(self): return 0
        def get_run_id(self): return "t"
        def shutdown(self): return True

    return NoRendezvous()


def test_agent_stops_workers_with_the_jobs_grace_not_torchs_30s(tmp_path):
    """Restarts and membership changes stop workers through ``_stop_workers``: a drain that
    saves a big state gets ``timeouts.shutdown_grace``, not torchelastic's fixed 30 s."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    from elastic_harness.agent.elastic import AgentSettings, HarnessAgent

    spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=no_rendezvous(), entrypoint="true")
    agent = HarnessAgent(spec=spec, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
                         shutdown_grace=77, settings=AgentSettings(judge=lambda: None))
    seen = []
    agent.shutdown = lambda death_sig=None, timeout=30: seen.append(timeout)
    agent.stop_workers(agent.worker_group)
    assert seen == [77]
    assert agent.health()[0]


# ----- state a model carries -------------------------------------------------------------
def test_compiled_and_bf16_models_save_and_load_under_clean_names(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # not /tmp

    from elastic_harness.runtime.state import ModelState

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to(torch.bfloat16)
    compiled = torch.compile(model, backend="eager")  # keys gain _orig_mod. in state_dict()
    state = ModelState(compiled).state_dict()
    assert set(state) == {"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                          "1.running_var", "1.num_batches_tracked"}
    dcp.save({"model": ModelState(compiled)}, checkpoint_id=str(tmp_path), no_dist=True)
    fresh = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to(torch.bfloat16)
    dcp.load({"model": ModelState(fresh)}, checkpoint_id=str(tmp_path), no_dist=True)
    assert model_digest(fresh) == model_digest(model)
    assert fresh[0].weight.dtype == torch.bfloat16


# ----- process group start ---------------------------------------------------------------
def test_a_rank_waits_for_rank_zeros_store_to_listen_before_connecting():
    import socket

    from elastic_harness.runtime.dist import wait_for_listener

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        port = sock.getsockname()[1]
        assert not wait_for_listener("127.0.0.1", port, timeout_s=0.05)
        sock.listen()
        assert wait_for_listener("127.0.0.1", port, timeout_s=5)


def test_a_restored_schedule_shorter_than_the_job_is_found_before_it_raises():
    """OneCycleLR keeps its saved total; stepped per update it would raise past it (issue 33).
    Its own count says how often it is stepped: one stepped per epoch is not short."""
    from torch.optim.lr_scheduler import ChainedScheduler, ExponentialLR, OneCycleLR, SequentialLR

    from elastic_harness.runtime.registration import short_schedule, short_schedule_error

    def stepped(s, n):
        for _ in range(n):
            s.optimizer.step()
            s.step()
        return s

    def opt():
        return torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)

    per_update = stepped(OneCycleLR(opt(), 0.1, total_steps=40), 40)
    assert short_schedule([per_update], 40, 40) is None
    assert short_schedule([None, per_update], 40, 60) == ("OneCycleLR", 40, 60, 40)
    e = short_schedule_error(short_schedule([per_update], 40, 60), 40, 60)
    assert "total_steps=40" in e.message and "train.steps at most 40" in e.hint and "LambdaLR" in e.hint
    per_epoch = stepped(OneCycleLR(opt(), 0.1, total_steps=5), 2)  # 2 epochs of 10 updates, of 50
    assert short_schedule([per_epoch], 20, 50) is None
    assert short_schedule([per_epoch], 20, 60) == ("OneCycleLR", 5, 6, 50)
    o = opt()
    chained = stepped(ChainedScheduler([OneCycleLR(o, 0.1, total_steps=10), ExponentialLR(o, 0.9)]), 10)
    assert short_schedule([chained], 10, 11)[0] == "OneCycleLR"
    o = opt()  # a later phase of a SequentialLR starts its own count at its milestone
    seq = stepped(SequentialLR(o, [ExponentialLR(o, 0.9), OneCycleLR(o, 0.1, total_steps=10)], milestones=[5]), 10)
    assert short_schedule([seq], 10, 15) is None
    assert short_schedule([per_update], 0, 60) is None  # a fresh start: nothing restored


def test_leaving_the_loop_is_said_only_when_nothing_else_explains_it():
    """The quickstart's demo printed "the script left its run.steps() loop after step 120
    ... not finished" for the survivor of a killed rank: its loop ended because of the
    failure (an exception through ``close``) or a stop its agent asked for, both said
    elsewhere. A script's own early exit is still said."""
    from types import SimpleNamespace

    from elastic_harness.runtime.loop import Loop

    said = []

    def close(requested=False):  # what ``Run.close`` says of a loop left after step 120 of 400
        loop = Loop(SimpleNamespace(train=SimpleNamespace(steps=400)), None, None, None, rank=0)
        loop.left_at = 120
        message = loop.unfinished(quiet=False, drain_requested=requested)
        if message:
            said.append(message)

    close()
    assert len(said) == 1 and "left its run.steps() loop after step 120" in said[0]
    try:
        raise ConnectionError("Connection closed by peer")
    except ConnectionError:
        close()
    close(requested=True)
    assert len(said) == 1


def test_the_agent_waits_for_news_between_monitor_passes(tmp_path):
    """torch's own loop only ticks (``MONITOR_TICK_S``); the agent waits out its monitor
    interval in ``monitor_workers``, and a ``nudge`` (the rendezvous changed) ends the wait."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    from elastic_harness.agent.elastic import MONITOR_TICK_S, AgentSettings, HarnessAgent

    spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=no_rendezvous(), entrypoint="true",
                      monitor_interval=MONITOR_TICK_S)
    agent = HarnessAgent(spec=spec, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
                         settings=AgentSettings(judge=lambda: None), monitor_interval=600.0)
    assert agent.monitor_interval == 600.0
    assert not agent.await_news(0.05)  # nothing happened: the whole (short) wait
    threading.Thread(target=agent.nudge).start()
    assert agent.await_news(120)  # ends at the nudge, long before the timeout would
    agent.nudge()
    agent.nudge()  # nudges that pile up are one
    assert agent.await_news(120)
    assert not agent.await_news(0.05)
