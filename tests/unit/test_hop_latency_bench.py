"""benchmarks.hop_latency's timing loop and table, without its child processes."""

from __future__ import annotations

from benchmarks import hop_latency


def test_round_trips_time_only_the_call_and_sleep_the_gap_before_each():
    now = [0]  # ns, a fake clock: the call takes 2 ms, a sleep what it is asked
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += int(s * 1e9)

    calls: list[int] = []

    def one() -> None:
        calls.append(now[0])
        now[0] += 2_000_000

    times = hop_latency.time_round_trips(one, n=4, warmup=2, gap_s=0.01,
                                         clock=lambda: now[0], sleep=sleep)
    assert times == [2000.0] * 4  # us: the call, never the gap
    assert slept == [0.01] * 4  # before each timed call, none before the warm-up ones
    assert calls == [0, 2_000_000, 14_000_000, 26_000_000, 38_000_000, 50_000_000]


def test_table_checks_the_targets_on_the_unix_channel(capsys):
    hop_latency.summarize({"pipe": [40.0] * 10, "channel-unix": [90.0] * 10,
                           "ray": [400.0] * 10})
    out = capsys.readouterr().out
    assert "channel-unix        90.0      90.0      90.0        2.25       4.44" in out
    assert "met   channel p50 within 2.5x the pipe's (2.25x)" in out
    assert "met   channel >= 3x faster than the Ray call (4.44x)" in out
    assert "met   channel p99 <= 500 us (90 us)" in out
