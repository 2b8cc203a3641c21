"""A declared experiment that checks projections against measurements (issue 14 (a),
experiments/projection-validation.toml): records files labelled by the declaration, each
row's projections against its measured run (`reference_in = "row"`), runs repeated in time
pooled into their median (`median_over`), seconds shown as ms (`scale`); the probes taken
before and after the suites and fed to a projection onto `this`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvbench import experiment
from kvbench.errors import KvbenchError
from kvbench.experiment import load_experiment, load_records, render
from kvbench.present.table import Table

FIX = Path(__file__).parent / "fixtures" / "experiment"


def rec(name: str, metric: str, value: float, provenance: str, **params: object) -> dict:
    return {"schema_version": 1, "kind": "run", "name": name, "metric": metric, "unit": "s",
            "direction": "lower", "value": value, "status": "ok", "reason": "",
            "provenance": provenance, "params": {"batch": 1, **params}, "samples": [value],
            "git_commit": "abc1234def", "time": "2026-11-23T12:00:00+00:00"}


def rnd(full: tuple[float, float, float], quest: tuple[float, float, float]) -> list[dict]:
    """One round: each strategy's measured step, projected step and carried share."""
    return [r for name, (m, p, c) in (("full", full), ("quest", quest)) for r in (
        rec(name, "tbt", m, "measured"), rec(name, "tbt", p, "projected", hardware="this"),
        rec(name, "carried_share", c, "projected", hardware="this"))]


# two rounds of two strategies, measured and projected; the files' rounds come from the
# declaration (validation.toml)
FILES = {"validation-1.jsonl": rnd((0.050, 0.055, 0.2), (0.080, 0.072, 0.4)),
         "validation-2.jsonl": rnd((0.060, 0.066, 0.4), (0.070, 0.084, 0.5))}


@pytest.fixture
def validation() -> experiment.Experiment:
    for name, recs in FILES.items():  # the fixture files are FILES
        assert (FIX / name).read_text() == "".join(json.dumps(r) + "\n" for r in recs)
    return load_experiment(FIX / "validation.toml")


def test_validation_experiment_renders_its_golden_table(
        validation: experiment.Experiment) -> None:
    assert render(validation) == (FIX / "validation.md").read_text()


def test_a_records_file_labels_its_records(validation: experiment.Experiment) -> None:
    got = {(r["name"], r["params"]["round"], r["value"]) for r in load_records(validation)
           if r["metric"] == "tbt" and r["provenance"] == "measured"}
    assert got == {("full", 1, 0.05), ("full", 2, 0.06), ("quest", 1, 0.08),
                   ("quest", 2, 0.07)}


def test_each_row_against_its_measured_run(validation: experiment.Experiment) -> None:
    """Error = projected / measured - 1 of the same strategy and round; per column its
    median and worst absolute error under the table."""
    t = Table(validation.tables[1], load_records(validation), validation.aliases)
    assert t.cell(t.cells[("quest / 1", "projected")], "projected", "quest / 1") \
        == "72.0 (-10.0%), carried 40%"
    assert t.cell(t.cells[("quest / 1", "measured")], "measured", "quest / 1") == "80.0"
    assert t.changes() == ["- provenance projected: median 10.0%, worst 20.0% (n=4)"]


def test_rounds_pool_into_their_median(validation: experiment.Experiment) -> None:
    """The median over rounds of the measured and of the projected steps, the error of
    the medians, and the extra's median over the rounds; every round's records counted."""
    t = Table(validation.tables[0], load_records(validation), validation.aliases)
    full = t.cells[("full", "projected")]
    assert full["value"] == pytest.approx(0.0605)
    assert t.cell(full, "projected", "full") == "60.5 (+10.0%), carried 30%"
    assert t.provenance().startswith("Records: 8 runs, 12 records")


def test_a_row_with_two_references_and_a_bad_setting_are_refused(
        validation: experiment.Experiment) -> None:
    recs = load_records(validation)
    pivot = dataclasses.replace(validation.tables[1], reference={"name": "full"})
    with pytest.raises(KvbenchError, match=r"the reference .* matches two runs in row "
                                           r"'full / 1'"):
        Table(pivot, recs, validation.aliases)
    with pytest.raises(KvbenchError, match="reference_in 'cell': column or row"):
        Table(dataclasses.replace(pivot, reference_in="cell"), recs, validation.aliases)


def test_a_projection_onto_this_is_built_from_its_probes(
        validation: experiment.Experiment, tmp_path: Path) -> None:
    """`probes` name the files `this` is built from; a file missing when the projection
    runs is refused with one line, and a probe set for a named profile at load."""
    proj = validation.projections[0]
    assert proj.hardware == ("this",) and [p.name for p in proj.probes] == [
        "probes-before.jsonl", "probes-after.jsonl"]
    with pytest.raises(KvbenchError, match=r"projection input '.*probes-before\.jsonl' does "
                                           r"not exist"):
        experiment.project(dataclasses.replace(validation, projections=(dataclasses.replace(
            proj, source=FIX / "records.jsonl", out=tmp_path / "p.jsonl"),)))
    text = (FIX / "validation.toml").read_text().replace('hardware = "this"',
                                                         'hardware = "a6000-pcie4"')
    (tmp_path / "v.toml").write_text(text)  # paths are the repository's
    with pytest.raises(KvbenchError, match="probes: only hardware 'this'"):
        load_experiment(tmp_path / "v.toml")


def test_run_takes_the_probes_before_and_after_the_suites(
        validation: experiment.Experiment, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import kvbench.suite as suite_mod

    order: list[str] = []
    ours = tmp_path / "grid.toml"
    fake = suite_mod.Suite(ours, "grid", tmp_path / "grid.jsonl", [], [], {}, 0.05)
    monkeypatch.setattr(suite_mod, "load_suite", lambda p: dataclasses.replace(
        fake, path=Path(p), output=tmp_path / f"{Path(p).stem}.jsonl"))

    def run_suite(suite: suite_mod.Suite, out: Path, resume: bool = False,
                  only: str | None = None) -> int:
        order.append(out.name)
        out.write_text("")
        return 0

    monkeypatch.setattr(suite_mod, "run_suite", run_suite)
    monkeypatch.setattr(suite_mod, "units", lambda s, only=None: [1])
    monkeypatch.setattr(experiment, "project", lambda e: order.extend(
        p.out.name for p in e.projections) or 0)
    probes = (ours, tmp_path / "before.jsonl", tmp_path / "after.jsonl")
    exp = dataclasses.replace(validation, suites=(ours,), probes=probes,
                              records=(tmp_path / "summary.jsonl",))
    assert experiment.run(exp, resume=False) == 0
    assert order == ["before.jsonl", "grid.jsonl", "after.jsonl", "projected.jsonl"]
    order.clear()
    experiment.run(exp, resume=True)  # --resume keeps the probes before the runs
    assert order == ["grid.jsonl", "after.jsonl", "projected.jsonl"]
