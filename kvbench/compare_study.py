"""Does `kvbench compare` cry wolf? Its verdicts between unchanged runs (issue 11 item 17).

An experiment's `[[derive]] function = "kvbench.compare_study:false_alarms"` reads unchanged
runs of each probe (a suite case repeated: each repetition is one run, told apart by its
`method.suite_case`, in the order they ran) and judges them as `kvbench compare` does, at
its defaults (threshold 5%, alpha 0.05):

- each consecutive pair of single runs (run i against run i+1): how many exit 1
  (`pairs_flagged` of `pairs`), how many of those compare names a shift of the whole run
  (`kvbench.compare.common_shift`: the machine, not the code), and the median and 90th
  percentile of |change| of the quantities it tests (`abs_change_p50`, `abs_change_p90`);
- the same pairs with the new run made 2x slower (GB/s halved, times doubled): how many
  exit 1 (`slowdown_caught`, which must be every pair);
- groups of four runs a side (runs 0-3 against 4-7, 4-7 against 8-10 and 0, odd against
  even 1-7 / 2-8; with four or more runs a side compare tests the runs' medians): how many
  exit 1 (`groups_flagged` of `groups`), and whether runs 4-7 with their GB/s halved
  regress against runs 0-3 (`halved_caught`, 1 or 0; probes without GB/s have none).

The records are measurements of compare itself on measured runs (PROVENANCE "measured"),
named after the probe, one per quantity above.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvbench.schema import Record, measured

PROVENANCE = "measured"  # kvbench.derive: compare's verdicts on measured runs, not a model
RECORD_PARAMS = ("runs",)
GROUPS = (((0, 1, 2, 3), (4, 5, 6, 7)), ((4, 5, 6, 7), (8, 9, 10, 0)),
          ((1, 3, 5, 7), (2, 4, 6, 8)))
TIME_UNITS = {"s", "ms", "us", "ns"}


def slowed(rs: Any, times: bool = True) -> Any:
    """`rs` made 2x slower: GB/s halved and, with `times`, every time doubled."""
    from kvbench.store import ResultSet

    def f(r: dict[str, Any]) -> float:
        return 0.5 if r["unit"] == "GB/s" else 2.0 if times and r["unit"] in TIME_UNITS \
            else 1.0

    return ResultSet(rs.path, envs=rs.envs, records=[
        {**r, "value": r["value"] * f(r), "samples": [x * f(r) for x in r["samples"]]}
        if r["value"] is not None else r for r in rs.records])


def probe_runs(records: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """probe -> its runs (one ResultSet per suite unit, in the order they ran)."""
    from kvbench.store import ResultSet

    units: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(dict)
    for r in records:
        unit = (r.get("method") or {}).get("suite_case")
        if r.get("kind") == "probe" and unit:
            units[r["name"]].setdefault(unit, []).append(r)
    return {probe: [ResultSet(Path(unit), records=recs) for unit, recs in runs.items()]
            for probe, runs in units.items()}


def _merged(runs: list[Any]) -> Any:
    from kvbench.store import ResultSet

    return ResultSet(Path("runs"), records=[r for rs in runs for r in rs.records])


def verdicts(runs: list[Any]) -> dict[str, float]:
    """The quantities of the module docstring for one probe's runs (two or more)."""
    from kvbench.compare import common_shift, compare_sets, regressed

    flagged = shifts = caught = 0
    changes: list[float] = []
    for a, b in itertools.pairwise(runs):
        rows = compare_sets(a, b)
        bad = bool(regressed(rows))
        flagged += bad
        shifts += bad and common_shift(rows, 0.05) is not None
        changes += [abs(r.change) for r in rows if r.test.startswith("mann-whitney")
                    and r.change is not None]
        caught += bool(regressed(compare_sets(a, slowed(b))))
    out = {"pairs": len(runs) - 1, "pairs_flagged": flagged, "shifts_named": shifts,
           "slowdown_caught": caught}
    if changes:
        q = sorted(changes)
        out |= {"abs_change_p50": statistics.median(q),
                "abs_change_p90": q[int(0.9 * (len(q) - 1))]}
    groups = [(base, new) for base, new in GROUPS if max(base + new) < len(runs)]
    if groups:
        out |= {"groups": len(groups), "groups_flagged": sum(
            bool(regressed(compare_sets(_merged([runs[i] for i in base]),
                                        _merged([runs[i] for i in new]))))
            for base, new in groups)}
        base = _merged(runs[:4])
        if any(r["unit"] == "GB/s" for r in base.records):
            out["halved_caught"] = float(bool(regressed(compare_sets(
                base, slowed(_merged(runs[4:8]), times=False)))))
    return out


UNITS = {"pairs": "pairs", "pairs_flagged": "pairs", "shifts_named": "pairs",
         "slowdown_caught": "pairs", "abs_change_p50": "ratio", "abs_change_p90": "ratio",
         "groups": "groups", "groups_flagged": "groups", "halved_caught": "bool"}


def false_alarms(records: list[dict[str, Any]]) -> list[Record]:
    """`[[derive]]` entry point: the verdicts of every probe with two or more runs."""
    out = []
    for probe, runs in sorted(probe_runs(records).items()):
        if len(runs) < 2:
            continue
        for metric, value in verdicts(runs).items():
            out.append(measured("probe", probe, metric, UNITS[metric], "none", [value],
                                {"runs": len(runs)},
                                {"model": "kvbench.compare_study", "threshold": 0.05,
                                 "alpha": 0.05, "units": [rs.path.name for rs in runs]}))
    return out
