"""Figures the bandwidth probe derives from its sweeps (issue 3, CXL paper section 3.1).

Per pair and memory kind: the peak, the size reaching 90% of it, the half-bandwidth size and
the small-copy latency floor of one sweep (medians per size, GB/s); and the stability records,
the median over sizes >= 1M of per-size coefficients of variation, within one sweep or across
the sweeps of a `--repeat` run (the issue's bar: under 5% on an idle machine).
The stability records are diagnostics of spread: direction "none", so compare shows them and
never judges them (issue 11.17). The derived figures are one value each, which compare
judges only when a suite guard vouches for a threshold (kvbench.compare).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

from kvbench.schema import Record, measured
from kvbench.timing import Stats
from kvbench.units import format_size

STABLE_SIZE = 1 << 20  # the stability bar covers sizes from 1M
CV_BAR = 0.05  # issue 3: median CV under 5% across repeated sweeps on an idle machine


def at_fraction(sizes: Sequence[int], values: Sequence[float], frac: float) -> float:
    """Smallest size whose bandwidth reaches frac x peak, interpolated in log2(size) between
    the swept sizes around the crossing (the first swept size if it already reaches it)."""
    target = frac * max(values)
    for i, v in enumerate(values):
        if v >= target:
            if i == 0:
                return float(sizes[0])
            lo, hi = math.log2(sizes[i - 1]), math.log2(sizes[i])
            t = (target - values[i - 1]) / (v - values[i - 1])
            return 2 ** (lo + t * (hi - lo))
    raise ValueError("no value reaches the peak")  # unreachable: max(values) reaches it


def derived(name: str, sizes: list[int], gbs: list[float], params: dict[str, Any]
            ) -> list[Record]:
    """Peak, 90%-of-peak size, half-bandwidth size and latency floor of one pair's sweep
    (medians per size, GB/s); measured-derived, so provenance stays 'measured'."""
    how = "derived from this run's median bandwidth per size"
    floor_us = min(s / (g * 1e9) for s, g in zip(sizes, gbs, strict=True)) * 1e6
    rows = [("peak_bandwidth", "GB/s", "higher", max(gbs), "max over sizes"),
            ("size_90pct_peak", "B", "lower", at_fraction(sizes, gbs, 0.9),
             "smallest size reaching 90% of peak, log2-interpolated"),
            ("half_bandwidth_size", "B", "lower", at_fraction(sizes, gbs, 0.5),
             "smallest size reaching 50% of peak (n1/2), log2-interpolated"),
            ("latency_floor", "us", "lower", floor_us, "min over sizes of size / bandwidth")]
    return [measured("probe", name, metric, unit, direction,  # type: ignore[arg-type]
                     [value], params, {"derived": f"{rule}; {how}"})
            for metric, unit, direction, value, rule in rows]


def cv_by_size(sweeps: Sequence[dict[int, float]]) -> dict[int, float]:
    """size -> coefficient of variation (Stats.cv: std with ddof 1 over mean) of that size's
    value across sweeps, for the sizes >= STABLE_SIZE present in every sweep."""
    common = set.intersection(*(set(sw) for sw in sweeps)) if sweeps else set()
    return {s: Stats.of([sw[s] for sw in sweeps]).cv for s in sorted(common) if s >= STABLE_SIZE}


def stability(name: str, metric: str, cvs: dict[int, float], params: dict[str, Any],
              load: float, how: str, bar: bool) -> Iterator[Record]:
    """One informational record (direction "none") whose samples are the per-size CVs (sizes
    >= 1M) and whose value is their median, with the 1-minute load average at the run's start
    and now; none without sizes."""
    if not cvs:
        return
    rec = measured("probe", name, metric, "ratio", "none", list(cvs.values()), params,
                   {"derived": f"median over sizes >= 1M of the {how}",
                    "sizes": ",".join(format_size(s) for s in cvs),
                    "loadavg_1m_start": load, "loadavg_1m_end": os.getloadavg()[0]})
    if bar:
        rec.method.update({"bar": f"< {CV_BAR} on an idle machine",
                           "pass": rec.value is not None and rec.value < CV_BAR})
    yield rec
