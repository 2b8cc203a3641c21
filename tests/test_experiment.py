"""Declared experiments (kvbench.experiment, kvbench.present.pivot): tables pivoted from
records, every committed experiment's table.md equal to what its committed records render,
and bad declarations refused with one line before anything runs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import assert_usage_error, cli

from kvbench import experiment
from kvbench.errors import KvbenchError
from kvbench.experiment import load_experiment, render
from kvbench.present.pivot import Pivot
from kvbench.present.table import Table

FIX = Path(__file__).parent / "fixtures" / "experiment"


def rec(name: str, metric: str, value: float, commit: str = "abc1234def", status: str = "ok",
        samples: list[float] | None = None, **params: object) -> dict:
    return {"schema_version": 1, "kind": "run", "name": name, "metric": metric, "unit": "x",
            "direction": "lower", "value": value, "status": status, "reason": "killed -9"
            if status == "error" else "", "provenance": "measured",
            "params": {"mode": "eval", **params}, "samples": samples or [value],
            "stats": {"mean": sum(samples or [value]) / len(samples or [value])},
            "git_commit": commit, "time": "2026-11-26T07:00:00+00:00"}


RECORDS = [
    rec("full", "perplexity", 10.0),
    rec("full", "tokens_attended_per_step", 512, where="accel"),
    rec("quest", "perplexity", 12.5, budget_tokens=64, variant="authors"),
    rec("quest", "tokens_attended_per_step", 70, budget_tokens=64, variant="authors",
        where="accel"),
    rec("quest", "perplexity", 11.0, budget_tokens=128, variant="authors", commit="fff0000aa"),
    rec("quest", "perplexity", 13.0, budget_tokens=64, variant="kernel"),
    rec("h2o", "perplexity", 20.0, gpu_tokens=64),
    rec("h2o", "tokens_attended_per_step", 60, gpu_tokens=64, where="accel"),
    rec("h2o", "tokens_attended_per_step", 5, gpu_tokens=64, where="host"),
    rec("h2o", "perplexity", 0.0, gpu_tokens=128, status="error"),
    rec("quest", "trace.pages", 0, budget_tokens=64, variant="authors", layer=0,
        samples=[1.0, 3.0]),
    rec("quest", "trace.pages", 0, budget_tokens=64, variant="authors", layer=1,
        samples=[4.0, 4.0]),
]


def serialised() -> str:
    return "".join(json.dumps(r) + "\n" for r in RECORDS)


@pytest.fixture
def toy() -> experiment.Experiment:
    assert (FIX / "records.jsonl").read_text() == serialised()  # the fixture is RECORDS
    return load_experiment(FIX / "toy.toml")


def test_toy_experiment_renders_its_golden_table(toy: experiment.Experiment) -> None:
    assert render(toy) == (FIX / "toy.md").read_text()


def test_cells_trace_to_records(toy: experiment.Experiment) -> None:
    """Each cell is its run's value, change vs the reference and the summed extra."""
    t = Table(toy.tables[0], RECORDS, toy.aliases)
    assert t.ref["value"] == 10.0
    assert t.cell(t.cells[("quest (variant authors)", 64)], 64) == "12.500 (+25.0%), 70 tok"
    assert t.cell(t.cells[("h2o", 64)], 64) == "20.000 (+100.0%), 65 tok"  # accel + host
    assert t.cell(t.cells.get(("h2o", 128)), 128) == "-"  # the error run is left out...
    assert "h2o perplexity (killed -9)" in t.provenance()  # ...and listed
    assert "commits abc1234, fff0000" in t.provenance()
    recalls = Table(toy.tables[1], RECORDS, toy.aliases)
    assert recalls.cells[("authors", 64)]["value"] == 2.0 + 4.0  # sum over layers of means


def test_two_runs_in_one_cell_are_refused(toy: experiment.Experiment) -> None:
    pivot = Pivot(title="t", metric="perplexity", rows=("name",), columns="budget")
    with pytest.raises(KvbenchError, match=r"table 't': two runs for one cell \(row 'quest', "
                                           r"budget 64\)"):
        Table(pivot, RECORDS, toy.aliases)


def test_an_extra_with_several_records_needs_sum_over(toy: experiment.Experiment) -> None:
    from kvbench.present.pivot import Extra

    pivot = Pivot(title="t", metric="perplexity", rows=("name", "variant"), columns="budget",
                  extras=(Extra("tokens_attended_per_step"),))
    t = Table(pivot, RECORDS, toy.aliases)
    with pytest.raises(KvbenchError, match="2 records of 'tokens_attended_per_step'"):
        t.cell(t.cells[("h2o", 64)], 64)
    host = dataclasses.replace(pivot, extras=(Extra("tokens_attended_per_step",
                                                     where={"where": "host"}),))
    t = Table(host, RECORDS, toy.aliases)
    assert t.cell(t.cells[("h2o", 64)], 64).endswith(", 5")  # the host's record alone
    assert t.cell(t.cells[("quest (variant authors)", 64)], 64).startswith("12.500")
    assert t.cell(t.cells[("quest (variant authors)", 64)], 64).count(",") == 0  # no host


def test_a_per_layer_table_shows_the_statistic_asked_for(toy: experiment.Experiment) -> None:
    """A trace record's value is its median over steps; `statistic = "mean"` shows the
    mean, one column per layer, and a record without that statistic is refused."""
    pivot = Pivot(title="t", metric="trace.pages", rows=("name",), columns="layer",
                  statistic="mean", change=False)
    t = Table(pivot, RECORDS, toy.aliases)
    assert {k: r["value"] for k, r in t.cells.items()} == {("quest", 0): 2.0,
                                                           ("quest", 1): 4.0}
    assert Table(dataclasses.replace(pivot, statistic="value"), RECORDS,
                 toy.aliases).cells[("quest", 0)]["value"] == 0
    with pytest.raises(KvbenchError, match=r"statistic 'p10' is not in the stats of quest "
                                           r"trace\.pages"):
        Table(dataclasses.replace(pivot, statistic="p10"), RECORDS, toy.aliases)


@pytest.mark.parametrize("name", experiment.names())
def test_every_committed_table_is_what_its_records_render(name: str) -> None:
    """A declared experiment not run yet has neither records nor a table."""
    exp = load_experiment(name)
    if not any(p.exists() for p in exp.records):
        assert not (exp.out / "table.md").exists()
        return
    assert (exp.out / "table.md").read_text() == render(exp)


@pytest.mark.parametrize("name", experiment.names())
def test_every_committed_record_names_an_environment_its_file_holds(name: str) -> None:
    """The environment is stored with every record: each records file holds the env line
    of every env_id its records name (a fold must not drop another suite's)."""
    from kvbench.store import read_lines

    for path in (p for p in load_experiment(name).records if p.exists()):
        lines = [json.loads(ln) for ln in read_lines(path)]
        envs = {r["env_id"] for r in lines if r.get("kind") == "env"}
        named = {r["env_id"] for r in lines if r.get("kind") != "env" and r.get("env_id")}
        assert named <= envs, (path.name, sorted(named - envs))


BAD = [
    ("suites = [\"suites/nope.toml\"]", "unknown suite 'suites/nope.toml'"),
    ("[[table]]\ntitle = \"t\"\nmetric = \"perplexity\"\nrows = \"name\"\ncolumns = \"bugdet\"",
     "table 't': unknown parameter 'bugdet'"),
    ("[[table]]\ntitle = \"t\"\nmetric = \"perplexity\"\nrows = \"name\"\ncolumns = \"batch\"\n"
     "where = { name = \"qeust\" }", "unknown strategy or probe 'qeust'"),
    ("[[table]]\ntitle = \"t\"\nmetric = \"perplexity\"\nrows = \"name\"", "'columns' is "
     "required"),
    ("[[table]]\ntitle = \"t\"\nmetric = \"perplexity\"\nrows = \"name\"\ncolumns = \"batch\"\n"
     "colour = 1", "unknown key 'colour'"),
    ("oops = 1", "unknown key 'oops'"),
    ("[[table]]\ntitle = \"t\"\nmetric = \"perplexity\"\nrows = \"name\"\ncolumns = \"batch\"\n"
     "statistic = \"avg\"", "statistic 'avg': one of cv, iqr, max, mean, median"),
    ("[[table]]\ntitle = \"t\"\nmetric = \"perplexity\"\nrows = \"name\"\ncolumns = \"batch\"\n"
     "[[table.extra]]\nmetric = \"top10_recall\"\nwhere = { lyaer = 1 }",
     "table 't': unknown parameter 'lyaer'"),
    ("[[derive]]\nfunction = \"kvbench.prefix.roi:derivd\"\nout = \"x.jsonl\"",
     "derive 1: unknown derive function 'kvbench.prefix.roi:derivd'"),
    ("[[table]]\ntitle = \"t\"\nmetric = \"perplexity\"\nrows = \"name\"\ncolumns = \"batch\"\n"
     "spread_stats = [\"min\", \"maks\"]", "statistic 'maks': one of"),
    ("[[control]]\ntitle = \"c\"\nwhere = { name = \"quest\" }\nreference = { name = \"full\" }\n"
     "match = [\"prompt_lne\"]", "control 'c': unknown parameter 'prompt_lne'"),
    ("[[control]]\ntitle = \"c\"\nwhere = { name = \"quest\" }", "control 1: 'reference' is "
     "required"),
    ("[[control]]\ntitle = \"c\"\nwhere = {}\nreference = {}\ntolerance = 5",
     "control 1: tolerance 5: a share from 0 to 1"),
    ("[[table]]\ntitle = \"t\"\nmetric = \"perplexity\"\nrows = \"name\"\ncolumns = \"batch\"\n"
     "reference = { name = \"full\" }\npaired = true",
     "table 1: paired: needs median_over and a reference"),
]


@pytest.mark.parametrize(("extra", "message"), BAD)
def test_bad_declarations_are_refused_with_one_line(tmp_path: Path, extra: str,
                                                    message: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    head, _, tables = extra.partition("[[table]]")
    path = tmp_path / "bad.toml"
    path.write_text("[experiment]\nname = \"bad\"\nrecords = [\"x.jsonl\"]\n"
                    + (head if "=" in head and not tables else "")
                    + ("[[table]]" + tables if tables else ""))
    with pytest.raises(KvbenchError, match=message.replace("(", r"\(")):
        load_experiment(path)
    assert_usage_error(cli(["experiment", "render", str(path)], capsys), message)
    assert_usage_error(cli(["experiment", "run", str(path)], capsys), message)


def test_unknown_metric_and_unknown_experiment(tmp_path: Path,
                                               toy: experiment.Experiment) -> None:
    text = (FIX / "toy.toml").read_text().replace('metric = "perplexity"',
                                                   'metric = "perplexitty"')
    path = tmp_path / "m.toml"
    path.write_text(text)
    with pytest.raises(KvbenchError, match="unknown metric 'perplexitty'"):
        render(load_experiment(path))
    with pytest.raises(KvbenchError, match="unknown experiment 'nope' \\(known: "):
        load_experiment("nope")


def test_run_folds_the_suites_outputs_into_the_records(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A re-run suite's records replace its old ones; another suite's records stay, and so
    does the environment line they name (the outputs' own environment lines come once)."""
    import dataclasses

    import kvbench.suite as suite_mod

    ours, other = tmp_path / "a.toml", tmp_path / "b.toml"
    for s in (ours, other):
        s.write_text("")
    target = tmp_path / "summary.jsonl.gz"

    def tagged(r: dict, suite: Path, case: str, version: str = "1") -> str:
        return json.dumps({**r, "version": version,
                           "method": {"suite": str(suite), "suite_case": case}}) + "\n"

    env_old = json.dumps({"schema_version": 1, "kind": "env", "env_id": "old-env",
                          "env": {}}) + "\n"
    env_new = env_old.replace("old-env", "new-env")
    old = [env_old, env_new, tagged(RECORDS[0], ours, "c1"), tagged(RECORDS[6], other, "c9"),
           tagged(RECORDS[5], ours, "c2"), tagged(RECORDS[2], ours, "c2", "0")]
    from kvbench.store import open_text, read_lines

    with open_text(target, "w") as f:
        f.writelines(old)
    out = tmp_path / "a-out.jsonl"
    fake = suite_mod.Suite(ours, "a", out, [], [], {}, 0.05)
    monkeypatch.setattr(suite_mod, "load_suite", lambda p: fake)

    def run_suite(suite: object, path: Path, resume: bool, only: str | None) -> int:
        path.write_text(env_new + tagged(RECORDS[2], ours, "c2"))  # c2 re-run at version 1
        return 0

    monkeypatch.setattr(suite_mod, "run_suite", run_suite)
    monkeypatch.setattr(suite_mod, "units", lambda s, only=None: [1])
    exp = dataclasses.replace(load_experiment(FIX / "toy.toml"), suites=(ours,),
                              records=(target,), keep_traces=())
    assert experiment.run(exp, resume=False) == 0
    lines = [json.loads(ln) for ln in read_lines(target)]
    assert [r["env_id"] for r in lines if r["kind"] == "env"] == ["old-env", "new-env"]
    got = [(r["name"], r["value"], r["version"]) for r in lines if r["kind"] != "env"]
    # c1 (not re-run), c9 (another suite) and c2 at version 0 stay; c2 at version 1 is new
    assert got == [("full", 10.0, "1"), ("h2o", 20.0, "1"), ("quest", 12.5, "0"),
                   ("quest", 12.5, "1")]


def _one_suite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
               ) -> tuple[experiment.Experiment, Path, list[tuple[bool, set[str]]]]:
    """A toy experiment over one fake suite of cases c1 and c2 whose output already holds
    both; run_suite records (resume, the cases its output holds when it starts)."""
    import kvbench.suite as suite_mod
    from kvbench.store import unit_key

    spec, out = tmp_path / "a.toml", tmp_path / "a-out.jsonl"
    spec.write_text("")
    env = json.dumps({"schema_version": 1, "kind": "env", "env_id": "e", "env": {}})
    out.write_text("".join(f"{ln}\n" for ln in [env] + [json.dumps(
        {**RECORDS[0], "method": {"suite": str(spec), "suite_case": c}}) for c in ("c1", "c2")]))
    monkeypatch.setattr(suite_mod, "load_suite",
                        lambda p: suite_mod.Suite(spec, "a", out, [], [], {}, 0.05))
    calls: list[tuple[bool, set[str]]] = []

    def run_suite(suite: object, path: Path, resume: bool, only: str | None) -> int:
        calls.append((resume, {k for ln in path.read_text().splitlines()
                               if (k := unit_key(json.loads(ln)))}))
        return 0

    class Unit:
        def __init__(self, key: str) -> None:
            self.key = key

    monkeypatch.setattr(suite_mod, "run_suite", run_suite)
    monkeypatch.setattr(suite_mod, "units", lambda s, only=None: [
        Unit(c) for c in ("c1", "c2") if only is None or only == c])
    exp = dataclasses.replace(load_experiment(FIX / "toy.toml"), suites=(spec,),
                              records=(tmp_path / "summary.jsonl.gz",), keep_traces=())
    return exp, out, calls


def test_an_earlier_output_is_refused_without_resume(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain run does not continue an earlier output silently (it would measure nothing):
    one line naming it, nothing run; --resume continues it, the recorded cases kept."""
    exp, _, calls = _one_suite(tmp_path, monkeypatch)
    with pytest.raises(KvbenchError, match="holds an earlier run: pass --resume"):
        experiment.run(exp, resume=False)
    assert calls == []
    assert experiment.run(exp, resume=True) == 0
    assert calls == [(True, {"c1", "c2"})]


def test_only_measures_its_cases_again(tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """--only drops its cases' records from the output before they run (the others and the
    environment line stay); with --resume it runs only what is not recorded."""
    exp, out, calls = _one_suite(tmp_path, monkeypatch)
    assert experiment.run(exp, resume=False, only="c2") == 0
    assert calls == [(True, {"c1"})]
    assert json.loads(out.read_text().splitlines()[0])["kind"] == "env"


def test_a_declared_projection_sweeps_and_labels_its_records(tmp_path: Path) -> None:
    """Every point of the sweep is projected from the source's runs, labelled by its
    bookkeeping setting and provenance 'projected'; the table pivots them."""
    import dataclasses

    from kvbench.store import load

    exp = load_experiment("hgca-fig12")
    proj = dataclasses.replace(exp.projections[0], out=tmp_path / "p.jsonl",
                               sweep={"model": ("opt-6.7b",), "batch": (1, 4),
                                      "prompt_len": (1920,), "gen_len": (128,),
                                      "bookkeeping": ("none", "measured")})
    n = experiment.project(dataclasses.replace(exp, projections=(proj,)))
    recs = load(tmp_path / "p.jsonl").records
    assert n == len(recs) > 0 and {r["provenance"] for r in recs} == {"projected"}
    gz = dataclasses.replace(proj, out=tmp_path / "p.jsonl.gz")  # committed compressed
    assert experiment.project(dataclasses.replace(exp, projections=(gz,))) == n
    assert (tmp_path / "p.jsonl.gz").read_bytes()[:2] == b"\x1f\x8b"
    assert [r["value"] for r in load(tmp_path / "p.jsonl.gz").records] == [
        r["value"] for r in recs]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["p.jsonl", "p.jsonl.gz"]
    tps = [r for r in recs if r["metric"] == "decode_tokens_per_s"]
    assert {(r["name"], r["params"]["batch"], r["params"]["bookkeeping"]) for r in tps} == {
        (s, b, k) for s in ("offload", "h2o", "hgca") for b in (1, 4)
        for k in ("none", "measured")}
    h2o = {(r["params"]["kv_home"], r["params"]["batch"]): r["value"] for r in tps
           if r["name"] == "h2o" and r["params"]["bookkeeping"] == "none"}
    assert h2o[("host", 4)] < h2o[("accel", 4)]  # as the paper ran it: loads over PCIe
    assert any(r["metric"] == "link_bytes_per_step" and r["params"].get("kv_home") == "host"
               and r["params"]["where"] == "h2d" and r["value"] > 0 for r in recs)
    t = Table(exp.tables[1], recs, exp.aliases)  # table 2: bookkeeping none
    row = t.cells[("opt-6.7b (batch 4)", "hgca / 1 / -")]  # hgca at beta 1 (also run at 0)
    assert (row["params"]["bookkeeping"], row["params"]["beta"]) == ("none", 1.0)
    ratio = row["value"] / t.cells[("opt-6.7b (batch 4)", "offload / - / -")]["value"]
    assert f"| {ratio:.2f}x |" in "\n".join(t.markdown())


INLINE = """[experiment]
name = "inline"
records = ["x.jsonl"]

[suite]
name = "inline-runs"
output = "results/inline/runs.jsonl"

[[case]]
strategy = "streaming"
params = { mode = "eval", prompt_len = 1, gen_len = 7, gpu_tokens = 4 }
"""


def test_scouts_figures_are_projected_from_the_run_at_the_papers_budget_share() -> None:
    """ScoutAttention Figs. 8, 9 and 11 (results/scout): the paper attends 2048 tokens a step
    at every length, and a projection carries its source run's share of the context over, so
    every projected scout and infinigen record at a length comes from the run attending 2048
    of that length's share of the 8160-token source (within a block of 32)."""
    from kvbench.store import REPO_ROOT, load

    recs = [r for r in load(REPO_ROOT / "results/scout/projected.jsonl.gz").records
            if r["params"].get("figure") in ("fig8-fig11", "fig9")]
    shares = {(r["name"], r["params"]["prompt_len"], r["params"].get("budget_tokens"))
              for r in recs if r["name"] in ("scout", "infinigen")}
    assert {(n, length) for n, length, _ in shares} == {
        (n, length) for n in ("scout", "infinigen") for length in (8192, 16384, 32768, 65536)}
    for _, length, budget in shares:
        assert abs(budget - 2048 * 8160 / length) < 32, (length, budget)
    assert {r["params"]["prompt_len"] for r in recs if r["name"] == "hgca"} == {
        8192, 16384, 32768, 65536}


def test_runs_declared_inline_make_the_declaration_its_own_suite(tmp_path: Path,
                                                                capsys) -> None:
    """[suite] and [[case]] in the declaration: no suite file beside it (a strategy and its
    experiment in four files, CONTRIBUTING.md); an inline case is checked as a suite
    file's is, before anything runs."""
    from kvbench.suite import load_suite

    path = tmp_path / "inline.toml"
    path.write_text(INLINE)
    exp = load_experiment(path)
    assert exp.suites == (path.resolve(),)
    suite = load_suite(path)
    assert (suite.name, str(suite.output)) == ("inline-runs", "results/inline/runs.jsonl")
    assert [(c.name, c.params["gpu_tokens"]) for c in suite.cases] == [("streaming", 4)]
    path.write_text(INLINE.replace('"streaming"', '"streeming"'))
    assert_usage_error(cli(["experiment", "run", str(path)], capsys), "streeming")
    bare = tmp_path / "bare.toml"  # a suite file still refuses an experiment's keys alone
    bare.write_text(INLINE.replace("[experiment]", "[table]"))
    with pytest.raises(KvbenchError, match="unknown top-level key 'table'"):
        load_suite(bare)


def test_paired_change_takes_each_round_against_its_own_reference() -> None:
    """median_over = "repetition" with `paired`: the change of the medians beside the
    median and range of each round's change against the reference's run of that round
    (method.suite_repetition); a slow round moves both runs of its pair. A round without
    its reference is no pair; a declaration asking for pairs without rounds is refused."""
    def run(name: str, value: float, rep: int | None) -> dict:
        r = rec(name, "tbt", value, gpu_tokens=1)
        r["method"] = {"suite_case": f"{name}{rep}"}
        if rep is not None:
            r["method"]["suite_repetition"] = rep
        return r

    full = [run("full", v, i) for i, v in enumerate((10.0, 20.0, 12.0))]
    quest = [run("quest", v, i) for i, v in enumerate((6.0, 11.0, 8.0, 5.0))]
    pivot = Pivot(title="t", metric="tbt", rows=("name",), columns="gpu_tokens",
                  reference={"name": "full"}, median_over="repetition", paired=True, fmt=".1f")
    t = Table(pivot, full + quest, {})
    # medians 12 and 7: -41.7%; rounds -40%, -45%, -33.3% (round 3 has no full run)
    assert t.cell(t.cells[("quest", 1)], 1) == \
        "7.0 (-41.7%; paired -40.0% (-45.0% to -33.3%, 3 pairs))"
    unpaired = Table(dataclasses.replace(pivot, paired=False), full + quest, {})
    assert unpaired.cell(unpaired.cells[("quest", 1)], 1) == "7.0 (-41.7%)"
    old = [run("full", 10.0, None), run("quest", 6.0, None)]  # before suites recorded rounds
    assert Table(pivot, old, {}).cell(Table(pivot, old, {}).cells[("quest", 1)], 1) == \
        "6.0 (-40.0%)"

