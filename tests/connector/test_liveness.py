"""The adaptive liveness threshold (issue 18.4): it follows observed delays, never leaves
[floor, ceiling], and a peer silent past the ceiling is dead however slow it was before."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.connector.decode.liveness import DelayEstimator

FLOOR, CEILING = 1.5, 10.0
delays = st.lists(st.floats(0.0, 30.0, allow_nan=False), max_size=100)


def estimator(samples: list[float], floor: float = FLOOR, ceiling: float = CEILING) -> DelayEstimator:
    est = DelayEstimator(floor, ceiling)
    for d in samples:
        est.observe(d)
    return est


@given(delays)
def test_bounded_by_floor_and_ceiling(samples: list[float]) -> None:
    assert FLOOR <= estimator(samples).threshold() <= CEILING


@given(delays, st.integers(0, 99), st.floats(0.0, 30.0, allow_nan=False))
def test_monotone_in_every_delay(samples: list[float], i: int, extra: float) -> None:
    """Any delay made later never lowers the threshold."""
    if not samples:
        return
    i %= len(samples)
    later = [*samples[:i], samples[i] + extra, *samples[i + 1:]]
    assert estimator(later).threshold() >= estimator(samples).threshold()


@given(st.lists(st.floats(0.0, 0.05), min_size=1, max_size=60), st.floats(0.5, 2.0))
def test_a_burst_of_late_acks_raises_the_threshold(quiet: list[float], late: float) -> None:
    before = estimator(quiet).threshold()
    assert before == FLOOR  # an idle box: the floor, so a stopped peer is seen as fast as ever
    after = estimator([*quiet, *[late] * 3]).threshold()
    assert after > before and after >= min(CEILING, 2 * late)


@given(delays, st.floats(CEILING, 1e6, exclude_min=True))
def test_a_silent_peer_is_dead_by_the_ceiling(samples: list[float], silence: float) -> None:
    assert estimator(samples).overdue(silence)


@given(delays)
def test_a_ceiling_at_the_floor_is_the_old_fixed_timeout(samples: list[float]) -> None:
    est = estimator(samples, ceiling=0.0)
    assert not est.adaptive and est.threshold() == FLOOR
    assert est.overdue(FLOOR + 1e-9) and not est.overdue(FLOOR)


def test_old_samples_leave_the_window() -> None:
    """After a slow spell, a quiet one brings the threshold back to the floor."""
    est = estimator([3.0] * 10)
    assert est.threshold() == CEILING
    for _ in range(64):
        est.observe(0.001)
    assert est.threshold() == FLOOR


def test_clock_oddities_are_ignored() -> None:
    est = estimator([float("nan"), float("inf"), -1.0])
    assert est.count == 0 and est.threshold() == FLOOR


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        DelayEstimator(-1.0, 2.0)
    with pytest.raises(ValueError):
        DelayEstimator(1.0, 2.0, quantile=1.5)
