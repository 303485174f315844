"""``bench throughput``: its pure pieces and one tiny real run.

The smoke run checks the JSON's shape and that both sides trained exactly the samples
they were asked to; speeds and ratios are never asserted (they are the bench's output).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import pytest
import torch
import yaml

from elastic_harness.bench.throughput import main as tp
from elastic_harness.bench.throughput import sides
from elastic_harness.bench.throughput.data import CheapImages, CostlyImages, write_images
from elastic_harness.errors import HarnessError
from elastic_harness.spec import parse_job
from tests.conftest import cli

pytestmark = pytest.mark.timeout(120)


def bench_args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    tp.register(parser.add_subparsers())
    args = parser.parse_args(["throughput"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_steady_rate_skips_warmup_and_counts_intervals():
    stamps = [0.0, 9.0, 10.0, 10.5, 11.0, 12.0]  # step i starts at stamps[i]
    assert tp.steady_rate(stamps, warmup=2, global_batch=8) == pytest.approx(8 * 3 / 2.0)
    assert tp.steady_rate(stamps, warmup=0, global_batch=1) == pytest.approx(5 / 12.0)
    with pytest.raises(ValueError):
        tp.steady_rate(stamps, warmup=5, global_batch=8)  # one stamp left: no interval


def test_schedule_interleaves_and_alternates_who_goes_first():
    order = tp.schedule(3, ["cheap", "costly"])
    assert len(order) == 3 * 2 * 2
    assert order[:4] == [(0, "cheap", "harness"), (0, "cheap", "plain"),
                         (0, "costly", "harness"), (0, "costly", "plain")]
    assert order[4:6] == [(1, "cheap", "plain"), (1, "cheap", "harness")]
    for r in range(3):  # every repeat has each (case, side) once
        assert sorted(o[1:] for o in order if o[0] == r) == sorted(
            (c, s) for c in ("cheap", "costly") for s in ("harness", "plain"))


def _result(case, side, repeat, rate, samples=640, hook_ms=1.0):
    return {"case": case, "side": side, "repeat": repeat, "samples_per_s": rate, "samples": samples,
            "world_size": 2, "wall_s": 10.0, "hook_ms": hook_ms if side == "harness" else None}


def test_case_summary_is_ratio_of_medians_with_paired_ratios():
    results = [_result("cheap", "harness", r, v) for r, v in enumerate([100.0, 90.0, 300.0])]
    results += [_result("cheap", "plain", r, v) for r, v in enumerate([100.0, 100.0, 100.0])]
    results += [_result("costly", "plain", 0, 5.0)]  # another case: ignored
    s = tp.summarize_case(results, "cheap")
    assert s["harness_samples_per_s"] == 100.0 and s["plain_samples_per_s"] == 100.0
    assert s["ratio"] == 1.0
    assert s["paired_ratios"] == [1.0, 0.9, 3.0]
    assert s["samples_trained"] == {"harness": [640] * 3, "plain": [640] * 3}
    assert s["harness_hook_ms_median"] == 1.0


def test_goals_need_the_target_and_enough_repeats():
    assert tp.goal(0.98, 0.97, enough=True)["met"] is True
    assert tp.goal(0.96, 0.97, enough=True)["met"] is False
    assert tp.goal(2.0, 1.5, enough=False)["met"] is False
    assert tp.goal(None, 1.5, enough=True)["met"] is False
    results = [_result(c, s, r, 100.0 if s == "plain" else (99.0 if c == "cheap" else 160.0))
               for r in range(5) for c in tp.CASES for s in tp.SIDES]
    report = tp.summarize(results, bench_args(repeats=5), load=((1, 1, 1), (1, 1, 1)), kept=None)
    assert report["goals"]["cheap_harness_over_plain>=0.97"]["met"] is True
    assert report["goals"]["defaults_harness_over_plain>=0.97"]["met"] is True
    assert report["goals"]["costly_harness_over_plain>=1.5"]["met"] is True
    assert report["all_goals_met"] and report["note"] == ""
    short = tp.summarize(results, bench_args(repeats=2), load=((1, 1, 1), (1, 1, 1)), kept=None)
    assert not short["all_goals_met"] and "repeats" in short["note"]


def test_configurations_that_cannot_measure_are_refused():
    tp.check_args(bench_args())
    bad = [dict(steps=10, warmup=8), dict(global_batch=48, micro_batch=32), dict(items=10),
           dict(image_px=8), dict(workers=-1), dict(threads=0)]
    for kw in bad:
        with pytest.raises(HarnessError):
            tp.check_args(bench_args(**kw))
    tp.check_args(bench_args(global_batch=48, micro_batch=24, only=["cheap"]))


def test_harness_job_is_a_valid_script_job_with_checkpoints_off(tmp_path):
    args = bench_args(workers=3)
    for case, nproc in (("cheap", 2), ("costly", 1)):
        raw = sides.harness_job(args, tp.ROWS[case], tmp_path, tmp_path / "out.json", nproc, log_every=10)
        spec = parse_job(yaml.safe_dump(raw))
        assert spec.script.path.endswith("throughput/harness.py") and spec.nproc_per_node == nproc
        assert spec.checkpoint.every_steps == 0 and not spec.checkpoint.save_final
        assert spec.checkpoint.memory_every == 0  # no in-memory snapshots either
        assert spec.data.workers == (3 if case == "costly" else 0)
        assert (spec.train.global_batch_size, spec.train.micro_batch_size) == (64, 32)
    cmd = sides.plain_command(args, tp.ROWS["cheap"], tmp_path, tmp_path / "o.json", 2, tmp_path, 10)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert "elastic_harness.bench.throughput.plain" in cmd and f"--log-dir={tmp_path / 'logs'}" in cmd
    assert "--save-every" not in cmd


def test_defaults_row_is_the_harness_defaults_against_torch_save_at_the_same_interval(tmp_path):
    """What users pay: the harness with its checkpoint defaults (memory tier on, async saves,
    the final save) and a save every --save-every steps; the plain script torch.saves on
    rank 0 at the same interval."""
    from elastic_harness.spec.schema import CheckpointSpec

    args = bench_args(save_every=25)
    row = tp.ROWS["defaults"]
    spec = parse_job(yaml.safe_dump(sides.harness_job(args, row, tmp_path, tmp_path / "o.json", 2, 10)))
    assert spec.checkpoint == dataclasses.replace(CheckpointSpec(), every_steps=25)
    assert spec.checkpoint.memory_every >= 1 and spec.checkpoint.save_final  # the defaults
    cmd = sides.plain_command(args, row, tmp_path, tmp_path / "o.json", 2, tmp_path, 10)
    assert cmd[cmd.index("--save-every") + 1] == "25" and cmd[cmd.index("--save-dir") + 1] == str(tmp_path)
    assert cmd[cmd.index("--data") + 1] == "cheap"
    with pytest.raises(HarnessError, match="multiple of --save-every"):
        tp.check_args(bench_args(steps=100, warmup=20, save_every=50, only=["defaults"]))
    tp.check_args(bench_args(steps=120, warmup=20, save_every=50, only=["defaults"]))


def test_durable_row_is_the_defaults_less_the_memory_tier_and_sets_no_goal(tmp_path):
    from elastic_harness.spec.schema import CheckpointSpec

    args = bench_args(save_every=25)
    raw = sides.harness_job(args, tp.ROWS["durable"], tmp_path, tmp_path / "o.json", 2, 10)
    spec = parse_job(yaml.safe_dump(raw))
    assert spec.checkpoint == dataclasses.replace(CheckpointSpec(), every_steps=25, memory_every=0)
    results = [{"case": "durable", "side": s, "repeat": 0, "samples_per_s": 1.0, "cpu_ms_per_step": 1.0,
                "hook_ms": 0.1, "samples": 1, "world_size": 2, "wall_s": 1.0, "others_cores": 0.0}
               for s in tp.SIDES]
    report = tp.summarize(results, bench_args(repeats=5, only=["durable"]), load=((0, 0, 0), (0, 0, 0)), kept=None)
    assert report["durable"]["paired"]["median"] == 1.0 and report["goals"] == {}


def test_stream_rows_pair_each_repeat_and_keep_the_tier_off_without_saves(tmp_path):
    from elastic_harness.bench.throughput import stream as ts

    row = ts.StreamRow("costly", "costly", 1.5, costly=True)
    out = ts.summarize_row({"harness": [300.0, 200.0, 330.0], "plain": [200.0, 100.0, 200.0]},
                           {"harness": [50.0, 60.0, None], "plain": [100.0, 90.0, 80.0]}, row, 1, 2)
    assert out["paired_ratios"] == [1.5, 2.0, 1.65] and out["paired"]["median"] == 1.65 and out["met"]
    assert out["cpu_paired"]["median"] == 1.75 and out["cpu_paired"]["n"] == 2
    assert ts.decoder("costly") is ts.decode_costly and ts.decoder("cheap") is ts.decode
    paths = ts.write_shards(tmp_path / "s", 1, 2, jpeg_px=32)
    from elastic_harness.data import tar_stream

    samples = list(tar_stream(paths).open(paths[0]))
    x, y = ts.decode_costly(samples[0])
    assert tuple(x.shape) == (3, 32, 32) and 0 <= y < 10


def test_paired_ratios_come_with_their_spread_and_cpu_per_step():
    assert tp.spread([1.0, 0.9, 3.0, None]) == {"median": 1.0, "p25": 0.95, "p75": 2.0, "min": 0.9,
                                                  "max": 3.0, "n": 3}
    assert tp.spread([])["n"] == 0
    assert tp.cpu_per_step_ms([0.0, 5.0, 5.1, 5.3], warmup=1) == pytest.approx(150.0)
    results = [dict(_result("cheap", s, r, v), cpu_ms_per_step=c, phases_ms={"compute": c / 2})
               for r, (h, p, ch, cp) in enumerate([(90.0, 100.0, 110.0, 100.0), (100.0, 100.0, 100.0, 100.0)])
               for s, v, c in (("harness", h, ch), ("plain", p, cp))]
    s = tp.summarize_case(results, "cheap")
    assert s["paired"]["median"] == 0.95 and s["paired"]["n"] == 2
    assert s["cpu_paired"]["min"] == round(100 / 110, 4) and s["cpu_ms_per_step_median"]["harness"] == 105.0
    assert s["phases_ms"]["harness"] == {"compute": 52.5}


def test_others_load_is_the_busy_time_that_was_not_ours():
    assert sides.others_cores(busy_s=30.0, ours_s=10.0, wall_s=10.0) == 2.0
    assert sides.others_cores(busy_s=9.0, ours_s=10.0, wall_s=10.0) == 0.0  # tick rounding
    assert sides.others_cores(None, 10.0, 10.0) is None
    before = sides.machine_busy_s()
    assert before is None or before > 0


def test_both_data_sets_hold_the_same_images(tmp_path):
    write_images(tmp_path, 6, px=48)
    cheap, costly = CheapImages(tmp_path), CostlyImages(tmp_path)
    assert len(cheap) == len(costly) == 6
    x, y = costly[3]
    assert x.shape == cheap[3][0].shape == (3, 32, 32) and x.dtype == torch.float32
    assert y == cheap[3][1]
    torch.manual_seed(0)
    import random

    random.seed(1)
    a = costly[2][0]
    random.seed(1)
    assert torch.equal(a, costly[2][0])  # augmentation draws only from `random`


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_smoke_both_sides_train_the_same_samples(tmp_path):
    # Only the costly case (one rank each side, the harness with one loader process): two
    # launches instead of four keep this within the suite's e2e budget; it still runs both
    # sides end to end, the loader processes and the JPEG decoding. The cheap case differs
    # only in the data set class and rank count (unit-tested above).
    out = tmp_path / "tp.json"
    r = cli("bench", "throughput", "--only", "costly", "--workers", "1", "--repeats", "1", "--steps", "6",
            "--warmup", "2", "--hidden", "16", "--items", "64", "--image-px", "40", "--global-batch", "8",
            "--micro-batch", "4", "--dir", str(tmp_path), "--out", str(out), timeout=280)
    assert r.code == 0, r.err[-3000:]
    report = json.loads(out.read_text())
    assert json.loads(r.out) == report
    assert "cheap" not in report and set(report["goals"]) == {"costly_harness_over_plain>=1.5"}
    assert not report["all_goals_met"] and report["note"]  # 1 repeat: never claims a goal
    c = report["costly"]
    assert c["samples_trained"] == {"harness": [48], "plain": [48]} == {
        s: [c["expected_samples"]] for s in ("harness", "plain")}
    assert c["world_size"] == {"harness": [1], "plain": [1]} and c["harness_data_workers"] == 1
    assert all(np.isfinite(v) and v > 0 for s in ("harness", "plain") for v in c["samples_per_s"][s])
    assert c["ratio"] > 0 and set(c["others_cores_median"]) == {"harness", "plain"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tp.json"]  # scratch removed


def test_the_hsdp_row_is_opt_in_and_both_sides_get_the_same_mesh(tmp_path):
    assert "hsdp" not in tp.cases_of(bench_args(only=None))
    args = bench_args(only=["hsdp"], micro_batch=16)
    assert tp.cases_of(args) == ["hsdp"] and tp.nproc_of(args, "hsdp") == 4
    tp.check_args(args)
    with pytest.raises(HarnessError, match="even number of ranks"):
        tp.check_args(bench_args(only=["hsdp"], micro_batch=16, nproc_layout=3, global_batch=48))
    row = tp.ROWS["hsdp"]
    job = sides.harness_job(args, row, tmp_path, tmp_path / "o.json", 4, 10)
    spec = parse_job(__import__("yaml").safe_dump(job))
    assert spec.parallelism == {"replicate": "auto", "shard": 2, "tensor": 1}
    plain = sides.plain_command(args, row, tmp_path, tmp_path / "o.json", 4, tmp_path, 10)
    assert plain[plain.index("--hsdp-shard") + 1] == "2"
    assert "--hsdp-shard" not in sides.plain_command(args, tp.ROWS["cheap"], tmp_path, tmp_path, 2, tmp_path, 10)


def test_a_failed_run_is_reported_with_its_pair_and_the_rest_is_kept(tmp_path, monkeypatch, capsys):
    """Issue 33: one plain run exiting 1 at repeat 4 threw the whole 6-minute bench away."""
    from elastic_harness.bench.throughput import data as image_data

    def launch(side, row, args, data_dir, run_dir, nproc, log_every):
        if (side, run_dir.name) == ("plain", "cheap-plain-3"):
            raise HarnessError("the plain run (cheap row) exited 1; it said: RuntimeError: boom", "re-run")
        rate = 100.0 if side == "plain" else 98.0
        stamps = [i * args.global_batch / rate for i in range(args.steps)]
        return {"stamps": stamps, "cpu": [0.01 * i for i in range(args.steps)], "hook_s": [0.001] * args.steps,
                "phases": {}, "samples": args.steps * args.global_batch, "world_size": 2, "wall_s": 1.0}

    monkeypatch.setattr(sides, "launch", launch)
    monkeypatch.setattr(image_data, "write_images", lambda *a: None)
    args = bench_args(repeats=6, only=["cheap"])
    results = tp.measure(args, tmp_path)
    assert len(results) == 12 and [x for x in results if x.get("failed")] == [
        {"repeat": 3, "case": "cheap", "side": "plain",
         "failed": "the plain run (cheap row) exited 1; it said: RuntimeError: boom"}]
    assert "cheap plain repeat 3 FAILED: the plain run (cheap row) exited 1" in capsys.readouterr().err
    report = tp.summarize(results, args, load=((0, 0, 0), (0, 0, 0)), kept=None)
    c = report["cheap"]
    assert c["good_pairs"] == 5 and c["paired_ratios"] == [0.98] * 5 and c["ratio"] == 0.98
    assert c["failed_pairs"] == [{"repeat": 3, "plain": "the plain run (cheap row) exited 1; it said: RuntimeError: boom"}]
    assert len(c["samples_per_s"]["harness"]) == 5  # repeat 3's harness run is left out with its pair
    assert report["goals"]["cheap_harness_over_plain>=0.97"]["met"] and report["failed_runs"] == 1
    assert tp.exit_code(report, ["cheap"]) == 0
    results = [x if x["side"] == "harness" else {**x, "failed": "exited 1"} for x in results]
    none = tp.summarize(results, args, load=((0, 0, 0), (0, 0, 0)), kept=None)
    assert none["cheap"]["good_pairs"] == 0 and none["cheap"]["ratio"] is None
    assert tp.exit_code(none, ["cheap"]) == 1 and not none["all_goals_met"]


def test_a_failed_side_is_named_by_its_error_not_torchruns_banner():
    from elastic_harness.bench.throughput.sides import said

    torchrun = ("[rank1]: Traceback (most recent call last):\n"
                "[rank1]: RuntimeError: Connection closed by peer [127.0.0.1]:4000\n"
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
                "============================================================\n"
                "plain.py FAILED\n------------------------------------------------------------\n"
                "============================================================\n")
    assert said(torchrun) == "[rank1]: RuntimeError: Connection closed by peer [127.0.0.1]:4000"
    assert said("step 10\nerror: data_dir is not readable\n  fix: ...\n") == "error: data_dir is not readable"
    assert said("step 10\n=====\n") == "step 10" and said("") == "(empty log)"


def test_restart_row_is_the_cheap_row_with_restarts_and_sets_no_goal(tmp_path):
    args = bench_args()
    cheap = parse_job(yaml.safe_dump(sides.harness_job(args, tp.ROWS["cheap"], tmp_path, tmp_path / "o.json", 2, 10)))
    spec = parse_job(yaml.safe_dump(sides.harness_job(args, tp.ROWS["restart"], tmp_path, tmp_path / "o.json", 2, 10)))
    assert cheap.recovery == "in_place" and spec.recovery == "restart"
    assert dataclasses.replace(spec, recovery="in_place", name=cheap.name) == cheap
    assert tp.GOALS["restart"] is None and tp.ROWS["restart"].opt_in
