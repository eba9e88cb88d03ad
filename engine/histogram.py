"""Fixed-bucket histograms for the counters workers and routers report (``stats()`` dicts,
rendered as Prometheus histograms by router/metrics.py)."""

from __future__ import annotations

import math


class Buckets:
    """Counts per bucket of ``bounds`` (each bound an inclusive upper edge, plus one bucket
    past the last) and the sum of what was observed."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, v: float) -> None:
        i = next((i for i, b in enumerate(self.bounds) if v <= b), len(self.bounds))
        self.counts[i] += 1
        self.total += v

    def pairs(self) -> list[tuple[float, int]]:
        """``[(upper bound, count), ...]``, the last bound ``inf``."""
        return list(zip([*self.bounds, math.inf], self.counts, strict=True))
