"""bench.cpuwindow: the busy fraction of a window, from /proc/stat samples."""

from __future__ import annotations

import pytest

from elastic_harness.bench.cpuwindow import Sampler, busy_fraction, busy_seconds

pytestmark = pytest.mark.timeout(30)


def test_the_window_is_bounded_by_the_samples_just_outside_it():
    samples = [(0.0, 0.0, 0.0), (1.0, 0.5, 2.0), (2.0, 2.5, 4.0), (3.0, 2.6, 6.0)]
    assert busy_fraction(samples, 1.2, 1.8) == 1.0  # from the sample at 1.0 to the one at 2.0
    assert busy_fraction(samples, 0.5, 2.5) == round(2.6 / 6.0, 3)
    assert busy_fraction(samples, -1.0, 1.0) is None, "no sample before the window"
    assert busy_fraction(samples, 2.5, 9.0) is None, "none after it"
    assert busy_seconds(samples, 1.2, 1.8) == 2.0  # busy CPU seconds, every CPU together
    assert busy_seconds(samples, 0.5, 2.5) == 2.6
    assert busy_seconds(samples, 2.5, 9.0) is None


def test_a_busy_loop_shows_as_busy():
    import os
    import time

    with Sampler() as s:
        t0 = time.time()
        while time.time() - t0 < 0.3:  # one core busy (of os.cpu_count())
            pass
        t1 = time.time()
        deadline = time.time() + 5
        while (not s.samples or s.samples[-1][0] < t1) and time.time() < deadline:
            time.sleep(0.01)
    busy = busy_fraction(s.samples, t0, t1)
    assert busy is not None and busy >= 0.9 / os.cpu_count()
