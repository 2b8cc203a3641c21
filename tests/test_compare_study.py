"""compare's verdicts between unchanged runs (kvbench.compare_study), on runs built here:
identical runs raise no alarm and every 2x slowdown is caught; a run that really moved is
flagged in the pair where it regresses, not in four-run groups; the derivation's records
are labelled measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbench import compare_study
from kvbench.derive import Derivation
from kvbench.errors import KvbenchError
from kvbench.schema import measured


def run(unit: str, gbps: float, us: float) -> list[dict]:
    """One unchanged run of a probe: a GB/s and a time quantity, five samples each."""
    out = []
    for metric, unit_, value, direction in (("bandwidth", "GB/s", gbps, "higher"),
                                            ("latency", "us", us, "lower")):
        r = measured("probe", "bandwidth", metric, unit_, direction,
                     [value * (1 + d) for d in (-0.004, -0.002, 0, 0.002, 0.004)],
                     {"size": 1024}, {"suite_case": unit})
        out.append({**r.to_dict(), "env_id": "e1"})
    return out


def runs(n: int, moved: int | None = None) -> list[dict]:
    return [r for i in range(n) for r in run(f"u{i}", 10.0 if i != moved else 7.0,
                                             5.0 if i != moved else 7.5)]


def test_unchanged_runs_raise_no_alarm_and_every_slowdown_is_caught() -> None:
    got = compare_study.verdicts(compare_study.probe_runs(runs(11))["bandwidth"])
    assert got == {"pairs": 10, "pairs_flagged": 0, "shifts_named": 0, "slowdown_caught": 10,
                   "abs_change_p50": 0.0, "abs_change_p90": 0.0, "groups": 3,
                   "groups_flagged": 0, "halved_caught": 1.0}


def test_a_run_that_moved_is_flagged_where_it_regresses() -> None:
    got = compare_study.verdicts(compare_study.probe_runs(runs(11, moved=5))["bandwidth"])
    # 4 against 5 regresses; 5 against 6 improves (compare exits 1 on regressions only)
    assert got["pairs_flagged"] == 1 and got["slowdown_caught"] == 10
    # four runs a side: compare tests the runs' medians, which one moved run leaves alone
    assert got["groups_flagged"] == 0


def test_the_derivation_labels_its_records_measured(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    d = Derivation("kvbench.compare_study:false_alarms", tmp_path / "v.jsonl", {})
    assert d.write(runs(3)) == 6  # pairs, flagged, shifts, caught, p50, p90 (no groups)
    from kvbench.store import load

    recs = load(tmp_path / "v.jsonl").records
    assert {(r["provenance"], r["kind"], r["name"]) for r in recs} == {
        ("measured", "probe", "bandwidth")}
    assert {r["metric"] for r in recs} == {"pairs", "pairs_flagged", "shifts_named",
                                           "slowdown_caught", "abs_change_p50",
                                           "abs_change_p90"}
    monkeypatch.setattr(compare_study, "PROVENANCE", "projected")  # a model's module
    with pytest.raises(KvbenchError, match="its record bandwidth pairs is not labelled "
                                           "projected"):
        d.write(runs(3))
