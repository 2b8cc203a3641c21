"""Direction-aware comparison of two result files, for CI regression checks.

A quantity is matched across files by (kind, name, metric, provenance, params). Its change
is the relative difference of medians, signed so that positive means better. A change
counts (regressed or improved) only when it is beyond the threshold AND the new samples are
distinguishable, by a two-sided Mann-Whitney U test at level alpha, from the base samples
moved by the threshold towards them (the change is beyond the threshold with significance,
not merely nonzero: a 6% shift of tight samples is not a 5% regression).

A verdict needs a known uncertainty (issue 11.17: compare must not cry wolf). When the
samples are too few for the test to ever reach alpha (a single derived value such as a
latency floor or a ratio of medians, a CV over two sizes), the threshold alone decides only
for a quantity its record declares exact (`method["exact"]`, e.g. a deterministic
perplexity) or when the caller vouches for the threshold as that quantity's tolerance (suite
guards, `thresholded=True`); otherwise the row is "untestable" and never regresses.
Quantities with direction "none" (diagnostics such as a sweep's CV) are informational.

Runs: every record of a quantity in a file is one run of it (files appended to by several
invocations, a probe's --repeat sweeps, suite repetitions). Samples within one run share
that run's machine state, so a machine that drifts between runs (a shared VM: 5-30% over
minutes, results/compare-noise) makes two unchanged single runs differ significantly. When
each side holds enough runs for the test to reach alpha (4 and 4 at 0.05), the test runs on
the runs' medians instead ("mann-whitney runs"), judging the change against the
run-to-run spread; with fewer, on the pooled samples ("mann-whitney"). A record timed in
passes spread over its run (kvbench.timing.Timing.join, `method.blocks`) gives one unit per
pass ("mann-whitney passes"). alpha is the level of the whole comparison: the rows' p-values
pass Benjamini-Hochberg, so unchanged files cry wolf with probability about alpha
however many quantities they hold, not alpha per quantity. Given a noise
calibration (kvbench.noise: N unchanged runs of the quantities on this machine class), a
change must also exceed the calibrated run-to-run noise (test "+ run noise"), which makes
single derived values testable too ("run noise").
Records whose environment, probe version or attention backend (method.backend: the native
kernel or the torch fallback) differ are compared and visibly marked.
"""

from __future__ import annotations

import fnmatch
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.noise import Spread
from kvbench.schema import RecordKey, record_key
from kvbench.store import ResultSet
from kvbench.timing import block_medians


@lru_cache(maxsize=256)
def _u_counts(n1: int, n2: int) -> tuple[int, ...]:
    """Number of orderings of n1 + n2 distinct values giving each U = 0..n1*n2."""
    if n1 == 0 or n2 == 0:
        return (1,)
    a = _u_counts(n1 - 1, n2)  # largest value in sample 2: U of sample 1 unchanged
    b = _u_counts(n1, n2 - 1)  # ... in sample 1: it beats all n2 others
    out = [0] * (n1 * n2 + 1)
    for u, c in enumerate(b):
        out[u] += c
    for u, c in enumerate(a):
        out[u + n2] += c
    return tuple(out)


def min_p_value(n1: int, n2: int) -> float:
    """The smallest two-sided p the exact test can give for these sample sizes."""
    if n1 == 0 or n2 == 0:
        return 1.0
    log_comb = math.lgamma(n1 + n2 + 1) - math.lgamma(n1 + 1) - math.lgamma(n2 + 1)
    return min(1.0, 2.0 * math.exp(-log_comb))  # 0.0 where comb overflows a float


def mann_whitney_p(x: list[float], y: list[float]) -> float:
    """Two-sided p-value of the Mann-Whitney U test (exact without ties, else normal)."""
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        return 1.0
    pooled = sorted([(v, 0) for v in x] + [(v, 1) for v in y])
    ranks = [0.0] * len(pooled)
    i, tie_term = 0, 0.0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        t = j - i + 1
        tie_term += t**3 - t
        i = j + 1
    r1 = sum(r for r, (_, g) in zip(ranks, pooled, strict=True) if g == 0)
    u = r1 - n1 * (n1 + 1) / 2
    if tie_term == 0 and n1 * n2 <= 2500:
        counts = _u_counts(n1, n2)
        total = sum(counts)
        k = round(u)
        lower, upper = sum(counts[: k + 1]) / total, sum(counts[k:]) / total
        return min(1.0, 2 * min(lower, upper))
    n = n1 + n2
    mu = n1 * n2 / 2
    var = n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1)))
    if var <= 0:
        return 1.0
    z = (abs(u - mu) - 0.5) / math.sqrt(var)
    return min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2)))


@dataclass
class Row:
    kind: str
    name: str
    metric: str
    provenance: str
    params: dict[str, Any]
    unit: str
    direction: str
    base: float | None
    new: float | None
    change: float | None  # relative, positive = better
    p_value: float | None
    test: str
    verdict: str  # regressed improved same noise missing added error unmeasured
    marks: list[str] = field(default_factory=list)
    noise: float | None = None  # largest relative change run-to-run noise explains


FORMATS = ("table", "markdown", "json")


def check_format(fmt: str) -> None:
    """KvbenchError unless `fmt` is one of the comparison's output formats."""
    if fmt not in FORMATS:
        raise KvbenchError(f"unknown format '{fmt}' ({', '.join(FORMATS)})")


def _matches(r: dict[str, Any], glob: str) -> bool:
    return fnmatch.fnmatch(r["metric"], glob) or fnmatch.fnmatch(f"{r['name']}.{r['metric']}",
                                                                 glob)


def check_globs(globs: Sequence[str], *sets: ResultSet) -> None:
    """KvbenchError naming the first --metric glob that matches no record of `sets` (an
    empty selection compares nothing and would pass)."""
    for g in globs:
        if not any(_matches(r, g) for rs in sets for r in rs.records):
            raise KvbenchError(f"--metric '{g}' matches no quantity of "
                               f"{' or '.join(sorted({str(rs.path) for rs in sets}))}")


def _pool(rs: ResultSet, pattern: str | Sequence[str] | None,
          ) -> dict[RecordKey, list[dict[str, Any]]]:
    globs = [pattern] if isinstance(pattern, str) else list(pattern or [])
    groups: dict[RecordKey, list[dict[str, Any]]] = {}
    for r in rs.records:
        if globs and not any(_matches(r, g) for g in globs):
            continue
        groups.setdefault(record_key(r), []).append(r)
    return groups


def _samples(recs: list[dict[str, Any]]) -> list[float]:
    out: list[float] = []
    for r in recs:
        if r["status"] == "ok" and r["value"] is not None:
            out.extend(r.get("samples") or [r["value"]])
    return out


def _run_medians(recs: list[dict[str, Any]]) -> list[float]:
    """One value per run (record) that measured: the median of its samples."""
    return [statistics.median(r.get("samples") or [r["value"]]) for r in recs
            if r["status"] == "ok" and r["value"] is not None]


def _units(recs: list[dict[str, Any]]) -> list[float]:
    """The test's units: per run (record) that measured, the median of each of its passes
    where it keeps them (`method.blocks`, kvbench.timing.Timing.join), else of its samples."""
    return [m for r in recs if r["status"] == "ok" and r["value"] is not None
            for m in block_medians(r.get("samples") or [r["value"]],
                                   (r.get("method") or {}).get("blocks") or [])]


def _fdr(rows: list[Row], alpha: float) -> None:
    """Benjamini-Hochberg over the rows a test judged: a change counts only when its p is
    at most the largest p_(k) <= k alpha / m (m rows with a p-value). When nothing changed
    the chance that any of the m rows is flagged is then about alpha, not m alpha. A row
    within the threshold enters with p = 1: its p measures a change significantly
    *smaller* than the threshold, no evidence of one beyond it."""
    tested = sorted((r.p_value if r.verdict != "same" else 1.0, i)
                    for i, r in enumerate(rows) if r.p_value is not None)
    m = len(tested)
    cutoff = max((p for k, (p, _) in enumerate(tested, 1) if p <= k * alpha / m), default=-1.0)
    for r in rows:
        if r.p_value is not None and r.p_value > cutoff and r.verdict in ("regressed",
                                                                          "improved"):
            r.verdict = "noise"
            r.marks.append(f"not significant among {m} tested (Benjamini-Hochberg)")


def _backends(recs: list[dict[str, Any]]) -> set[str]:
    """The attention backends (method.backend, per phase) that the records ran."""
    return {f"{phase}={b}" for r in recs
            for phase, b in ((r.get("method") or {}).get("backend") or {}).items()}


def compare_sets(base: ResultSet, new: ResultSet, threshold: float = 0.05, alpha: float = 0.05,
                 pattern: str | Sequence[str] | None = None, thresholded: bool = False,
                 noise: dict[RecordKey, Spread] | None = None) -> list[Row]:
    """One row per quantity present in either file, in base-file order then new-only ones.

    `pattern` is a glob or a list of globs; a record counts when any matches its metric or
    'name.metric'. `thresholded`: the threshold is the tolerance of every matched quantity,
    so too few samples to test are judged by the threshold alone (as the module says).
    `noise`: calibrated run-to-run spreads (kvbench.noise.load_calibration); the level alpha
    is shared among the calibrated quantities both files hold (Bonferroni)."""
    b, n = _pool(base, pattern), _pool(new, pattern)
    noise = noise or {}
    m = max(1, sum(1 for k in b if k in n and k in noise))
    rows = []
    for key in list(b) + [k for k in n if k not in b]:
        rb, rn = b.get(key, []), n.get(key, [])
        ref = (rb or rn)[0]
        row = Row(kind=key[0], name=key[1], metric=key[2], provenance=key[3],
                  params=ref.get("params") or {}, unit=ref["unit"], direction=ref["direction"],
                  base=None, new=None, change=None, p_value=None, test="", verdict="same")
        rows.append(row)
        if rb and rn:
            if {r["env_id"] for r in rb} != {r["env_id"] for r in rn}:
                row.marks.append("env differs")
            if {r.get("version") for r in rb} != {r.get("version") for r in rn}:
                row.marks.append("version differs")
            if _backends(rb) != _backends(rn):
                row.marks.append("attention backend differs")
        _judge(row, rb, rn, threshold, alpha, thresholded, noise.get(key), alpha / m)
    _fdr(rows, alpha)
    return rows


def _judge(row: Row, rb: list[dict[str, Any]], rn: list[dict[str, Any]], threshold: float,
           alpha: float, thresholded: bool, spread: Spread | None = None,
           noise_alpha: float = 0.05) -> None:
    if not rn:
        row.verdict = "missing"
        return
    if not rb:
        row.verdict = "added"
        return
    sb, sn = _samples(rb), _samples(rn)
    if not sn:
        bad = next(r for r in rn if r["status"] != "ok")
        row.marks.append(f"{bad['status']}: {bad.get('reason', '')}")
        # an error where the base measured is a regression; otherwise nothing to judge
        row.verdict = "error" if bad["status"] == "error" and sb else "unmeasured"
        return
    if not sb:
        row.verdict = "added"
        return
    test = "mann-whitney"
    mb, mn = _run_medians(rb), _run_medians(rn)
    ub, un = _units(rb), _units(rn)
    if min(len(ub), len(un)) >= 2 and min_p_value(len(ub), len(un)) <= alpha:
        passes = (len(ub), len(un)) != (len(mb), len(mn))
        sb, sn, test = ub, un, "mann-whitney passes" if passes else "mann-whitney runs"
    row.base, row.new = statistics.median(sb), statistics.median(sn)
    if row.direction == "none":
        row.test, row.verdict = "informational", "same"
        return
    sign = 1.0 if row.direction == "higher" else -1.0
    if row.base == 0:
        row.change = 0.0 if row.new == 0 else sign * math.copysign(math.inf, row.new)
    else:
        row.change = sign * (row.new - row.base) / abs(row.base)
    beyond = abs(row.change) > threshold
    outside = None  # beyond the calibrated run-to-run noise
    if spread is not None and row.base > 0 and row.new > 0:
        bound = spread.bound(len(mb), len(mn), noise_alpha)
        row.noise = math.expm1(bound)
        outside = abs(math.log(row.new / row.base)) > bound
    testable = min_p_value(len(sb), len(sn)) <= alpha
    if not testable and outside is not None:
        row.test, significant = "run noise", outside
    elif not testable:
        exact = all((r.get("method") or {}).get("exact") for r in rb + rn)
        if not (exact or thresholded):
            row.test, row.verdict = "untestable", "noise" if beyond else "same"
            return
        row.test = "threshold-only"
        significant = True
    else:  # beyond the threshold with significance: against the base moved by it
        moved = [x * (1 + math.copysign(threshold, row.new - row.base)) for x in sb]
        row.p_value = mann_whitney_p(moved, sn)
        row.test = test + (" + run noise" if outside is not None else "")
        significant = row.p_value < alpha and outside is not False
    if beyond and significant:
        row.verdict = "improved" if row.change > 0 else "regressed"
    else:
        row.verdict = "noise" if beyond else "same"


def select_env(rs: ResultSet, which: str) -> ResultSet:
    """The records of the machine(s) `which` names in one file: an env_id, a fleet machine
    name or class (kvbench.fleet), a host name or a hardware class; a class naming several
    machines pools them. KvbenchError (with what the file holds) when nothing matches."""
    from kvbench.suite import machine_class, machine_label

    def names(env_id: str, env: dict[str, Any]) -> set[str]:
        node = env.get("node") or {}
        return {env_id, node.get("name", ""), node.get("class", ""), env.get("hostname", ""),
                machine_class(env)} - {""}

    ids = {i for i, env in rs.envs.items() if which in names(i, env)}
    if not ids:
        have = ", ".join(f"{i} = {machine_label(e)}" for i, e in rs.envs.items())
        raise KvbenchError(f"no environment '{which}' in '{rs.path}' (it holds: {have})")
    return ResultSet(rs.path, {i: rs.envs[i] for i in ids},
                     [r for r in rs.records if r.get("env_id") in ids], rs.warnings)


def regressed(rows: list[Row]) -> list[Row]:
    """Rows that fail a regression check: worse beyond threshold, or newly erroring."""
    return [r for r in rows if r.verdict in ("regressed", "error")]


@dataclass(frozen=True)
class Shift:
    """A change shared by a whole comparison: `moved` of the `judged` quantities changed
    the same way, with median relative change `median` (+ better)."""

    judged: int
    moved: int
    median: float


def common_shift(rows: list[Row], threshold: float, share: float = 0.8) -> Shift | None:
    """The shift of the whole comparison, when there is one: five or more quantities
    judged, `share` of them changing the same way, and their median change beyond the
    threshold. A code change tends to move some quantities; a machine whose speed changed
    between the runs (a shared VM's host, a co-tenant, the clock) moves all of them, like
    the whole-run slowdowns of results/compare-noise. Nothing inside the two files tells
    the two apart: a calibration (--noise) or base and new re-run interleaved does."""
    changes = [r.change for r in rows if r.change is not None and math.isfinite(r.change)]
    if len(changes) < 5:
        return None
    median = statistics.median(changes)
    moved = sum(c * median > 0 for c in changes)
    if abs(median) <= threshold or moved < share * len(changes):
        return None
    return Shift(len(changes), moved, median)


def rows_to_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rows]
