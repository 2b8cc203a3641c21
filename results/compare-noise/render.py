"""Issue 11 item 17: false alarms of `kvbench compare` between unchanged runs.

Usage: .venv/bin/python results/compare-noise/render.py RUN_DIR LABEL
RUN_DIR holds PROBE-i.jsonl, runs i = 0..N-1 of each probe's default (pairs.sh writes
them; the raw files, ~5 MB, stay local). Writes LABEL.md beside this file: per probe, the
verdicts of the N-1 consecutive single-run pairs and of run groups four a side (runs
0-3 vs 4-7 and 4-7 vs 8-10+0, and the odd vs even runs 1-7 / 2-8), all at the default
threshold, plus the median and 90th percentile of |change| over the single-run pairs, and
whether runs 4-7 with their GB/s halved regress against runs 0-3 (they must).
"""

from __future__ import annotations

import itertools
import statistics
import sys
from pathlib import Path

from kvbench.compare import compare_sets, regressed
from kvbench.store import ResultSet, load

HERE = Path(__file__).parent
GROUPS = (((0, 1, 2, 3), (4, 5, 6, 7)), ((4, 5, 6, 7), (8, 9, 10, 0)),
          ((1, 3, 5, 7), (2, 4, 6, 8)))


def merged(sets: list[ResultSet]) -> ResultSet:
    out = ResultSet(Path("runs"))
    for s in sets:
        out.envs.update(s.envs)
        out.records.extend(s.records)
    return out


def halved(rs: ResultSet) -> ResultSet:
    """rs with every GB/s value and sample halved."""
    recs = [{**r, "value": r["value"] / 2, "samples": [x / 2 for x in r["samples"]]}
            if r["unit"] == "GB/s" and r["value"] is not None else r for r in rs.records]
    return ResultSet(rs.path, envs=rs.envs, records=recs)


def probe_row(runs: list[ResultSet]) -> str:
    alarms, changes = [], []
    for a, b in itertools.pairwise(runs):
        rows = compare_sets(a, b)
        alarms.append(sorted({r.metric for r in regressed(rows)}))
        changes += [abs(r.change) for r in rows if r.test == "mann-whitney"
                    and r.change is not None]
    single = sum(bool(x) for x in alarms)
    grouped = []
    for base, new in GROUPS:
        if max(base + new) < len(runs):
            rows = compare_sets(merged([runs[i] for i in base]), merged([runs[i] for i in new]))
            grouped.append(sorted({r.metric for r in regressed(rows)}))
    base = merged(runs[:4])
    half = "-" if not any(r["unit"] == "GB/s" for r in base.records) else \
        "yes" if regressed(compare_sets(base, halved(merged(runs[4:8])))) else "NO"
    q = sorted(changes)
    return (f"{single}/{len(alarms)} | {', '.join(sorted({m for x in alarms for m in x})) or '-'}"
            f" | {statistics.median(q):.3f} | {q[int(0.9 * (len(q) - 1))]:.3f} | "
            f"{sum(bool(x) for x in grouped)}/{len(grouped)} | "
            f"{', '.join(sorted({m for x in grouped for m in x})) or '-'} | {half}")


def main(run_dir: Path, label: str) -> None:
    lines = [f"# compare between unchanged runs: {label}", "",
             "| probe | single-run pairs that exit 1 | metrics flagged | median abs change "
             "| p90 abs change | 4-run groups that exit 1 | metrics flagged | runs 4-7 with GB/s "
             "halved exit 1 |", "|---|---|---|---|---|---|---|---|"]
    probes = sorted({p.name.rsplit("-", 1)[0] for p in run_dir.glob("*-[0-9]*.jsonl")})
    for probe in probes:
        files = sorted(run_dir.glob(f"{probe}-[0-9]*.jsonl"),
                       key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        lines.append(f"| {probe} | " + probe_row([load(f) for f in files]) + " |")
    (HERE / f"{label}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
