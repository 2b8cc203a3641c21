"""Issue 11 item 17: false alarms of `kvbench compare` between unchanged runs.

Usage: .venv/bin/python tools/studies/compare-noise/render.py RUN_DIR LABEL [CAL_DIR]
RUN_DIR holds PROBE-i.jsonl, runs i = 0..N-1 of each probe's default (pairs.sh writes
them; the raw files, ~5 MB, stay local). Writes results/compare-noise/LABEL.md: per probe, the
verdicts of the N-1 consecutive single-run pairs and of run groups four a side (runs
0-3 vs 4-7 and 4-7 vs 8-10+0, and the odd vs even runs 1-7 / 2-8), all at the default
threshold, how many of the single-run pairs that exit 1 compare names a shift of the
whole run (kvbench.compare.common_shift), the median and 90th percentile of |change| over
the single-run pairs,
whether each pair with its new run made 2x slower (GB/s halved, times doubled) exits 1, and
whether runs 4-7 with their GB/s halved regress against runs 0-3 (they must).
CAL_DIR (other unchanged runs of the same probes) adds the single-run pairs
judged against that noise calibration (`kvbench compare --noise`), and whether each run
made 2x slower (GB/s halved, times doubled) regresses against the run before it with it.
"""

from __future__ import annotations

import itertools
import statistics
import sys
from pathlib import Path

from kvbench.compare import common_shift, compare_sets, regressed
from kvbench.noise import load_calibration
from kvbench.store import ResultSet, load

OUT = Path(__file__).resolve().parents[3] / "results" / "compare-noise"  # the write-ups
GROUPS = (((0, 1, 2, 3), (4, 5, 6, 7)), ((4, 5, 6, 7), (8, 9, 10, 0)),
          ((1, 3, 5, 7), (2, 4, 6, 8)))


def merged(sets: list[ResultSet]) -> ResultSet:
    out = ResultSet(Path("runs"))
    for s in sets:
        out.envs.update(s.envs)
        out.records.extend(s.records)
    return out


TIME_UNITS = {"s", "ms", "us", "ns"}


def slowed(rs: ResultSet, times: bool = True) -> ResultSet:
    """rs made 2x slower: every GB/s value and sample halved and, with `times`, every time
    doubled (times=False: the issue's check, GB/s halved alone)."""
    def f(r: dict) -> float:
        return 0.5 if r["unit"] == "GB/s" else 2.0 if times and r["unit"] in TIME_UNITS else 1.0

    recs = [{**r, "value": r["value"] * f(r), "samples": [x * f(r) for x in r["samples"]]}
            if r["value"] is not None else r for r in rs.records]
    return ResultSet(rs.path, envs=rs.envs, records=recs)


def calibrated_row(runs: list[ResultSet], cal: ResultSet) -> str:
    """Single-run pairs judged with the calibration; each run 2x slower against the last."""
    noise = load_calibration([cal], runs)
    alarms, caught, within = [], 0, []
    for a, b in itertools.pairwise(runs):
        alarms.append(sorted({r.metric for r in regressed(compare_sets(a, b, noise=noise))}))
        rows = compare_sets(a, slowed(b), noise=noise)
        caught += bool(regressed(rows))
        judged = [r for r in rows if r.noise is not None
                  and (r.unit == "GB/s" or r.unit in TIME_UNITS)]
        within.append(sum(r.noise < 1.0 for r in judged) / max(1, len(judged)))
    runs_cal = max(s.runs for s in noise.values())
    return (f"{runs_cal} | {sum(bool(x) for x in alarms)}/{len(alarms)} | "
            f"{', '.join(sorted({m for x in alarms for m in x})) or '-'} | "
            f"{caught}/{len(alarms)} | {statistics.median(within):.0%}")


def probe_row(runs: list[ResultSet]) -> str:
    alarms, changes, caught, shifts = [], [], 0, 0
    for a, b in itertools.pairwise(runs):
        rows = compare_sets(a, b)
        alarms.append(sorted({r.metric for r in regressed(rows)}))
        shifts += bool(alarms[-1]) and common_shift(rows, 0.05) is not None
        changes += [abs(r.change) for r in rows if r.test.startswith("mann-whitney")
                    and r.change is not None]
        caught += bool(regressed(compare_sets(a, slowed(b))))
    single = sum(bool(x) for x in alarms)
    grouped = []
    for base, new in GROUPS:
        if max(base + new) < len(runs):
            rows = compare_sets(merged([runs[i] for i in base]), merged([runs[i] for i in new]))
            grouped.append(sorted({r.metric for r in regressed(rows)}))
    base = merged(runs[:4])
    half = "-" if not any(r["unit"] == "GB/s" for r in base.records) else \
        "yes" if regressed(compare_sets(base, slowed(merged(runs[4:8]), times=False))) else "NO"
    q = sorted(changes)
    return (f"{single}/{len(alarms)} | {', '.join(sorted({m for x in alarms for m in x})) or '-'}"
            f" | {shifts} | {statistics.median(q):.3f} | {q[int(0.9 * (len(q) - 1))]:.3f} | "
            f"{caught}/{len(alarms)} | {sum(bool(x) for x in grouped)}/{len(grouped)} | "
            f"{', '.join(sorted({m for x in grouped for m in x})) or '-'} | {half}")


def probe_runs(run_dir: Path, probe: str) -> list[ResultSet]:
    files = sorted(run_dir.glob(f"{probe}-[0-9]*.jsonl"),
                   key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    return [load(f) for f in files]


def main(run_dir: Path, label: str, cal_dir: Path | None = None) -> None:
    lines = [f"# compare between unchanged runs: {label}", "",
             "| probe | single-run pairs that exit 1 | metrics flagged | of those, named a "
             "whole-run shift | median abs change "
             "| p90 abs change | single-run pairs with the new run 2x slower that exit 1 "
             "| 4-run groups that exit 1 | metrics flagged | runs 4-7 with GB/s "
             "halved exit 1 |", "|---|---|---|---|---|---|---|---|---|---|"]
    probes = sorted({p.name.rsplit("-", 1)[0] for p in run_dir.glob("*-[0-9]*.jsonl")})
    for probe in probes:
        lines.append(f"| {probe} | " + probe_row(probe_runs(run_dir, probe)) + " |")
    if cal_dir is not None:
        lines += ["", f"With a noise calibration (`kvbench compare --noise`) of the runs in "
                  f"{cal_dir.name}/ (other unchanged runs of the same probes):", "",
                  "| probe | calibration runs | single-run pairs that exit 1 | metrics flagged "
                  "| pairs with the new run 2x slower that exit 1 | rate and time quantities "
                  "(median over pairs) where 2x is beyond the noise |",
                  "|---|---|---|---|---|---|"]
        for probe in probes:
            cal = merged(probe_runs(cal_dir, probe))
            lines.append(f"| {probe} | " + calibrated_row(probe_runs(run_dir, probe), cal)
                         + " |")
    (OUT / f"{label}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]) if sys.argv[3:] else None)
