"""Liveness thresholds that follow observed delays, so a peer that is slow but answers is never
declared dead, while one that stops answering still is, by a bounded time.

One estimator class, three uses on the decode side:
- per DEALER, over the round-trip times of P's heartbeat acks, and
- per consumer, over how late its own heartbeat ticks wake (a loaded box: a P sharing it gets the same
  slack): together, how long D waits on an unanswered heartbeat before it declares P dead;
- per consumer, over the gaps between its heartbeat ticks: the lease D asks P for (P caps it at its
  abort timeout), so a starved D does not lose its transfers.

threshold = clamp(margin × quantile(recent samples), floor, ceiling). The floor is what an idle box
gets (`--heartbeat-timeout`, or 7 heartbeat intervals for the lease), so a stopped peer is seen as fast
as before; the ceiling bounds how long any silence is tolerated however slow the history was.
"""

from __future__ import annotations

import math
from collections import deque

# Threshold = MARGIN × the QUANTILE of the last WINDOW samples: slack for a delay somewhat worse than
# any seen recently (a starved process's delays come in bursts that grow, not as one lone spike).
MARGIN = 4.0
QUANTILE = 0.99
WINDOW = 64  # 16 s of heartbeats at the default 0.25 s interval


class DelayEstimator:
    """Recent delays of one peer (or of our own loop) → how much silence is still normal."""

    def __init__(self, floor: float, ceiling: float, margin: float = MARGIN, quantile: float = QUANTILE,
                 window: int = WINDOW) -> None:
        if not floor >= 0 or not 0 <= quantile <= 1 or not margin > 0 or window < 1:
            raise ValueError("need floor >= 0, margin > 0, 0 <= quantile <= 1 and window >= 1")
        self.floor = floor
        self.ceiling = max(floor, ceiling)  # a ceiling at or below the floor: a fixed threshold
        self.margin = margin
        self.quantile = quantile
        self._samples: deque[float] = deque(maxlen=window)
        self._cached: float | None = None

    @property
    def adaptive(self) -> bool:
        return self.ceiling > self.floor

    def observe(self, delay: float) -> None:
        if math.isfinite(delay) and delay >= 0:  # a clock oddity proves nothing
            self._samples.append(delay)
            self._cached = None

    def threshold(self) -> float:
        if self._cached is None:
            self._cached = self._compute()
        return self._cached

    def _compute(self) -> float:
        if not self._samples or not self.adaptive:
            return self.floor
        ordered = sorted(self._samples)
        # Linear interpolation between order statistics: non-decreasing in every sample.
        pos = self.quantile * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        q = ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
        return min(max(self.floor, self.margin * q), self.ceiling)

    def overdue(self, silence: float) -> bool:
        """Whether `silence` seconds without an answer is more than this peer's recent delays allow."""
        return silence > self.threshold()

    @property
    def count(self) -> int:
        return len(self._samples)
