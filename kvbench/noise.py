"""Run-to-run noise of each quantity on one machine, calibrated from unchanged runs.

Samples within one run share that run's machine state (buffer placement, a VM's neighbours,
clocks), so a single run's samples say nothing about how far the next run of the same code
lands: on the 2-core VM the attention probe's run medians move by 2x between processes
(results/compare-noise). A calibration file is an ordinary result file holding N >= 3
unchanged runs of the quantities (each record one run: `kvbench probe attention --out F`
invoked N times). For each quantity the spread is the sample standard deviation s of the
log run medians, and two results that differ only by run-to-run noise have

    |log(new / base)| <= t * s * sqrt(1 / runs_base + 1 / runs_new),

with t the Student t quantile (N - 1 degrees of freedom) for P(|T| <= t) = 1 - alpha / m. That is
a prediction interval (t, as s is estimated from N runs) Bonferroni-corrected over the m
calibrated quantities a comparison judges, so the whole comparison cries wolf with
probability about alpha when nothing changed and the run medians are log-normal.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from kvbench.errors import KvbenchError
from kvbench.schema import RecordKey, record_key
from kvbench.store import ResultSet

MIN_RUNS = 3


@dataclass(frozen=True)
class Spread:
    """Standard deviation of a quantity's log run medians over `runs` unchanged runs."""

    sd_log: float
    runs: int

    def bound(self, runs_base: int, runs_new: int, alpha: float) -> float:
        """Largest |log(new / base)| that run-to-run noise explains at level alpha (one
        quantity's share of the comparison's level)."""
        t = t_quantile(1 - alpha, self.runs - 1)
        return t * self.sd_log * math.sqrt(1 / runs_base + 1 / runs_new)


def t_within(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer df >= 1 (the finite series of Abramowitz
    and Stegun 26.7.3-4 in theta = atan(t / sqrt(df)))."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 0:
        term = total = 1.0
        for k in range(2, df - 1, 2):  # (1.3...(k-1)) / (2.4...k) cos^k
            term *= (k - 1) / k * c2
            total += term
        return s * total
    if df == 1:
        return 2 * theta / math.pi
    term = total = 1.0
    for k in range(3, df - 1, 2):  # (2.4...(k-1)) / (1.3...k) cos^(k-1)
        term *= (k - 1) / k * c2
        total += term
    return 2 / math.pi * (theta + s * math.cos(theta) * total)


def t_quantile(level: float, df: int) -> float:
    """The t with P(|T| <= t) = level (bisection on t_within, to 1e-9 relative)."""
    lo, hi = 0.0, 1.0
    while t_within(hi, df) < level:
        lo, hi = hi, hi * 2
    while hi - lo > 1e-9 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_within(mid, df) < level else (lo, mid)
    return (lo + hi) / 2


def spreads(cal: ResultSet) -> dict[RecordKey, Spread]:
    """The spread of every quantity with >= MIN_RUNS positive run medians in `cal`
    (diagnostics with direction 'none' are not judged and get none)."""
    runs: dict[RecordKey, list[float]] = {}
    for r in cal.records:
        if r["status"] != "ok" or r["value"] is None or r["direction"] == "none":
            continue
        med = statistics.median(r.get("samples") or [r["value"]])
        if med > 0:
            runs.setdefault(record_key(r), []).append(math.log(med))
    return {k: Spread(statistics.stdev(v), len(v)) for k, v in runs.items()
            if len(v) >= MIN_RUNS}


def load_calibration(cals: list[ResultSet], compared: list[ResultSet]
                     ) -> dict[RecordKey, Spread]:
    """The spreads of the calibration files `cals`, for comparing the files `compared`.

    KvbenchError (exit 2) when the compared files span several machine classes, when a
    calibration file comes from another class (another machine's noise would excuse or flag
    the wrong changes) or holds no quantity with MIN_RUNS runs."""
    from kvbench.suite import machine_class

    def classes(rs: ResultSet) -> set[str]:
        used = {r.get("env_id") for r in rs.records}
        return {machine_class(e) for i, e in rs.envs.items() if i in used}

    machines = set().union(*(classes(rs) for rs in compared))
    if len(machines) != 1:
        raise KvbenchError("a noise calibration is for runs of one machine class; the compared "
                           f"files hold {', '.join(sorted(machines)) or 'none'}")
    out: dict[RecordKey, Spread] = {}
    for cal in cals:
        if classes(cal) != machines:
            raise KvbenchError(f"noise calibration '{cal.path}' is from "
                               f"{', '.join(sorted(classes(cal))) or 'no machine'}, the "
                               f"compared files from {', '.join(machines)}")
        found = spreads(cal)
        if not found:
            raise KvbenchError(f"noise calibration '{cal.path}' has no quantity with "
                               f"{MIN_RUNS} or more runs (append unchanged runs to it)")
        out.update(found)
    return out
