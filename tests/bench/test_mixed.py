"""How bench/mixed.py counts a workload's rate within a phase: only what ended before the
deadline, over the time until the last of it ended, each loop's rate on its own span."""

from __future__ import annotations

import math

from bench import mixed


def test_work_that_ends_after_the_deadline_is_not_counted(monkeypatch):
    now = iter([100.0, 104.0, 108.0, 111.0])
    monkeypatch.setattr(mixed.time, "perf_counter", lambda: next(now))
    clock, tally = mixed.Clock(10.0), mixed.Tally()  # from 100 s to 110 s
    assert clock.count(tally, 64, 4.0) and clock.count(tally, 64, 4.0)
    assert not clock.count(tally, 64, 3.0)  # ended at 111 s
    assert tally.units == 128 and tally.span == 8.0 and tally.latencies == [4.0, 4.0]
    assert tally.rate == 16.0


def test_streams_rates_are_each_streams_work_over_its_own_span_summed():
    streams = [mixed.Tally(units=100, span=10.0), mixed.Tally(units=90, span=9.0), mixed.Tally()]
    assert mixed.total_rate(streams) == 20.0  # a stream that ended nothing adds nothing
    streams[0].latencies, streams[1].latencies = [1.0, 3.0], [2.0]
    assert mixed.median_latency(streams) == 2.0
    assert math.isnan(mixed.median_latency([mixed.Tally()]))  # nothing ended
