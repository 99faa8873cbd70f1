"""The learnt spin window (cuvild/core/spin.py), on a clock the test moves."""

from __future__ import annotations

import pytest

from cuvild.core import spin as spin_mod
from cuvild.core.spin import GROW_FROM_S, Spin


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(spin_mod.time, "perf_counter", c)
    return c


def sleep_on_bell(spin: Spin, clock: Clock, wait_s: float) -> bool:
    """One wait whose bell rings after `wait_s`; whether it came while spinning."""
    rings_at = clock.now + wait_s

    def ready() -> bool:
        clock.now += 1e-6  # each check takes a microsecond
        return clock.now >= rings_at

    spun = spin.check(ready)
    if not spun:
        clock.now = max(clock.now, rings_at)
        spin.slept()
    return spun


def test_the_window_grows_on_short_waits_and_falls_to_nothing_on_a_long_one(clock: Clock):
    spin = Spin(400e-6)
    assert spin.window == 0
    assert not sleep_on_bell(spin, clock, 150e-6)  # no window yet: slept
    assert spin.window == GROW_FROM_S
    windows = []
    for _ in range(10):
        sleep_on_bell(spin, clock, 150e-6)
        windows.append(spin.window)
    # doubled while the bell came after the window, then kept: the bell comes within it
    assert windows[:4] == pytest.approx([20e-6, 40e-6, 80e-6, 160e-6])
    assert windows[4:] == pytest.approx([160e-6] * 6)
    assert sleep_on_bell(spin, clock, 150e-6)
    assert not sleep_on_bell(spin, clock, 2e-3)  # a long wait: spun 160 µs, then slept
    assert spin.window == 0
    for _ in range(5):
        assert not sleep_on_bell(spin, clock, 2e-3)  # a slow peer: never spun for again
    assert spin.window == 0


def test_the_window_never_passes_most_and_zero_means_never(clock: Clock):
    spin = Spin(100e-6)
    for _ in range(20):
        sleep_on_bell(spin, clock, 99e-6)
    assert spin.window == pytest.approx(100e-6)
    off = Spin(0.0)
    calls = []
    for _ in range(5):
        assert not off.check(lambda: calls.append(1))  # one look, no loop
        off.slept()
    assert off.window == 0 and len(calls) == 5


def test_check_returns_what_ready_gave(clock: Clock):
    spin = Spin()
    spin.window = 50e-6
    assert spin.check(lambda: [(3, 1)]) == [(3, 1)]
    looks = []

    def never() -> list[tuple[int, int]]:
        clock.now += 1e-6
        looks.append(1)
        return []

    assert spin.check(never) == []
    assert 49 <= len(looks) <= 51  # the window's worth of looks, then given up
