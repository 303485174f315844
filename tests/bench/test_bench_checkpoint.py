"""``bench checkpoint``'s pure summaries: ratios of what was measured, the paired spread of
the training overheads, and the CPU each save adds."""

from __future__ import annotations

import pytest

from elastic_harness.bench.checkpoint.main import extra_cpu, machine_per_save, ratios_of, spread
from elastic_harness.bench.cpuwindow import parse_cpu_line

pytestmark = pytest.mark.timeout(30)


def test_ratios_cover_only_what_was_measured():
    med = {"step_no_save": 0.1, "step_async_save": 0.102, "step_floor_direct": 0.101}
    r = ratios_of(med)
    assert r["step_overhead_async_save"] == pytest.approx(0.02)
    assert r["step_overhead_floor_direct"] == pytest.approx(0.01)
    assert r["async_save_over_floor_direct"] == pytest.approx(0.102 / 0.101 - 1)
    assert "async_blocking_over_sync_save" not in r  # --train-only measured no saves


def test_spread_pairs_each_window_with_the_no_save_window_of_its_round():
    samples = {"step_no_save": [0.1, 0.2, 0.1, 0.2], "step_async_save": [0.11, 0.22, 0.1, 0.2],
               "cpu_step_no_save": [1.0] * 4, "step_sync_save": [0.3]}
    s = spread(samples)
    assert set(s) == {"step_async_save"}  # cpu samples and unpaired kinds left out
    assert s["step_async_save"]["min"] == 0.0 and s["step_async_save"]["max"] == pytest.approx(0.1)
    assert s["step_async_save"]["median"] == pytest.approx(0.05)
    assert s["step_async_save"]["mean"] == pytest.approx(0.05)
    assert s["step_async_save"]["se"] == pytest.approx(0.0577 / 2, abs=1e-4)  # stdev of (.1,.1,0,0) / sqrt(4)


def test_extra_cpu_is_per_save():
    med = {"cpu_step_no_save": 0.15, "cpu_step_async_save": 0.16, "step_no_save": 0.1}
    assert extra_cpu(med, every=10) == {"async_save": pytest.approx(0.1)}


def test_machine_time_per_save_is_each_kinds_mean_against_no_save_by_where_it_went():
    samples = {"machine_steal_step_no_save": [0.0, 0.002], "machine_steal_step_async_save": [0.003, 0.003],
               "machine_idle_step_no_save": [0.010], "machine_idle_step_async_save": [0.004],
               "machine_user_step_floor_direct": [0.2], "step_no_save": [0.1]}
    assert machine_per_save(samples, every=10) == {
        "async_save": {"steal": pytest.approx(0.02), "idle": pytest.approx(-0.06)}}  # no base: floor left out


def test_cpu_line_sums_user_kernel_and_steal_columns():
    t = parse_cpu_line("cpu  100 10 20 300 4 5 6 7 0 0", ticks_per_s=100)
    assert t == {"user": 1.1, "kernel": pytest.approx(0.31), "idle": 3.0, "iowait": 0.04, "steal": 0.07}
    assert parse_cpu_line("cpu 1 2 3 4", 1)["steal"] == 0  # kernels before steal accounting


@pytest.mark.parametrize("direct", [True, False])
def test_the_floor_writes_exactly_the_bytes_and_their_crc(tmp_path, direct):
    import mmap
    import zlib

    from elastic_harness.bench.checkpoint.floor import ALIGN, CHUNK, write_durably

    size = CHUNK + 5000  # two chunks, the last one padded to whole blocks
    buf = mmap.mmap(-1, -(-size // ALIGN) * ALIGN)
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    buf[:size] = payload
    crc = write_durably(tmp_path / "f.bin", memoryview(buf), size, direct)
    assert (tmp_path / "f.bin").read_bytes() == payload
    assert crc == zlib.crc32(payload)
