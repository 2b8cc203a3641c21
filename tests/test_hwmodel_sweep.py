"""Projection sweeps over device configurations (kvbench.hwmodel.sweep) and `kvbench plan`
as records (kvbench.plan.records): the largest batch per strategy, PnG-KV's nearest
steady ratio, the busy-time breakdown, and the plan derived as records and a project-only run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from conftest import assert_usage_error, cli

from kvbench import experiment
from kvbench.errors import KvbenchError
from kvbench.hwmodel.sweep import Projection, records
from kvbench.models import get_spec
from kvbench.plan import PlanConfig, max_batch, plan_records
from kvbench.store import REPO_ROOT

SOURCE = REPO_ROOT / "results" / "hgca-fig12" / "source.jsonl"  # offload, h2o, hgca traces
K = 1024


def proj(**kw: object) -> Projection:
    base = {"source": SOURCE, "out": Path("unused"), "hardware": ("a100-pnm",),
            "sweep": {"model": ("llama-3.1-8b",), "prompt_len": (128 * K,), "gen_len": (4,),
                      "batch": ("max",), "gpus": (1, 2), "pnms": (0,)},
            "strategies": ("offload",), "budget_ratio": 1 / 16, "plan_config": "baseline",
            "tag": {"experiment": "x"}}
    return Projection(**{**base, **kw})


def test_each_point_runs_at_the_largest_batch_its_configuration_fits() -> None:
    got = records(proj(), "source.jsonl")
    assert {r.provenance for r in got} == {"projected"} and {r.name for r in got} == {"offload"}
    tps = {r.params["gpus"]: r for r in got if r.metric == "decode_tokens_per_s"}
    spec = get_spec("llama-3.1-8b")
    for g in (1, 2):
        want = max_batch(spec, 128 * K, PlanConfig(model=spec.name, gpus=g, pnms=0,
                                                   budget_ratio=1 / 16))
        p = tps[g].params
        assert p["batch"] == p["fits"] == want["baseline"] > 0
        assert (p["t_budget"], p["t_steady"], p["pnms"], p["experiment"]) == (8 * K, 0, 0, "x")
        assert p["hardware"] == f"a100-pnm:{g}gpu+0pnm"
    half = records(proj(batch_scale=0.5), "source.jsonl")
    assert [r.params["batch"] for r in half if r.metric == "decode_tokens_per_s"] == [
        tps[g].params["batch"] // 2 for g in (1, 2)]


def test_a_configuration_that_fits_nothing_is_waived_not_projected() -> None:
    sweep = {"model": ("llama-3.1-405b",), "prompt_len": (1024 * K,), "gen_len": (4,),
             "batch": ("max",), "gpus": (1,), "pnms": (0,)}
    got = records(proj(sweep=sweep), "source.jsonl")
    assert [(r.metric, r.status, r.reason, r.provenance) for r in got] == [
        ("decode_tokens_per_s", "waived", "no sequence fits", "projected")]


def test_the_breakdown_gives_busy_seconds_per_resource_and_op() -> None:
    got = records(proj(breakdown=True, sweep={**proj().sweep, "gpus": (1,)}), "source.jsonl")
    busy = [r for r in got if r.metric == "busy_seconds_per_step"]
    assert busy and all(":" in r.params["where"] and r.params["experiment"] == "x"
                        and r.provenance == "projected" for r in busy)
    assert {r.params["where"].split(":")[0] for r in busy} >= {"accel", "h2d"}
    assert len(busy[0].samples) == 4  # one per decode step (gen_len 4, none skipped)
    skipped = records(proj(breakdown=True, skip=1, sweep={**proj().sweep, "gpus": (1,)}),
                      "source.jsonl")
    assert len(next(r for r in skipped if r.metric == "busy_seconds_per_step").samples) == 3


def offload_runs(tmp_path: Path, extra: list[dict[str, object]]) -> Path:
    """A source file with SOURCE's offload run once per `extra`, its parameters updated by
    it (and SOURCE's env lines)."""
    lines = [json.loads(x) for x in SOURCE.read_text().splitlines()]
    runs = [x for x in lines if x.get("kind") == "run" and x["name"] == "offload"]
    src = tmp_path / "src.jsonl"
    with src.open("w") as f:
        for x in lines:
            if x.get("kind") != "run":
                f.write(json.dumps(x) + "\n")
        for more in extra:
            for x in runs:
                f.write(json.dumps({**x, "params": {**x["params"], **more}}) + "\n")
    return src


def test_png_kv_takes_the_source_run_nearest_its_steady_ratio(tmp_path: Path) -> None:
    """At #GPU g and #PNM n the run whose steady_ratio is nearest g / (g + n); without
    PNMs every run is projected."""
    src = offload_runs(tmp_path, [{"steady_ratio": 0.5}, {"steady_ratio": 0.2}])

    def ratios(pnms: int) -> list[float]:
        got = records(proj(source=src, sweep={**proj().sweep, "gpus": (1,), "pnms": (pnms,),
                                              "batch": (1,)}), "src.jsonl")
        return [r.params["steady_ratio"] for r in got if r.metric == "decode_tokens_per_s"]

    assert ratios(1) == [0.5] and ratios(4) == [0.2] and ratios(3) == [0.2]
    assert sorted(ratios(0)) == [0.2, 0.5]


def test_source_where_keeps_the_runs_whose_parameters_hold_its_values(tmp_path: Path) -> None:
    """Each target length projected from the run at its budget share: `source_where` keeps
    the runs whose parameters equal its values; a run without the parameter is left out,
    and a filter no run passes is refused."""
    src = offload_runs(tmp_path, [{"budget_tokens": 256}, {"budget_tokens": 2048}, {}])

    def budgets(where: dict[str, object]) -> list[object]:
        got = records(proj(source=src, source_where=where, sweep={
            **proj().sweep, "gpus": (1,), "batch": (1,)}), "src.jsonl")
        return [r.params.get("budget_tokens") for r in got if r.metric == "decode_tokens_per_s"]

    assert budgets({"budget_tokens": 256}) == [256]
    assert budgets({"budget_tokens": 2048}) == [2048]
    assert sorted(budgets({}), key=str) == [2048, 256, None]
    with pytest.raises(KvbenchError, match=r"src\.jsonl: no run of 'offload' to project "
                       r"where \{'budget_tokens': 512\}"):
        budgets({"budget_tokens": 512})
    with pytest.raises(KvbenchError, match=r"src\.jsonl: no run to project where "
                       r"\{'budget_tokens': 512\}"):
        records(proj(source=src, strategies=(), source_where={"budget_tokens": 512}),
                "src.jsonl")


def test_an_unknown_strategy_of_the_source_is_refused() -> None:
    with pytest.raises(KvbenchError, match=r"source\.jsonl: no run of 'quest' to project"):
        records(proj(strategies=("offload", "quest")), "source.jsonl")


def test_the_plan_as_records() -> None:
    got = plan_records(PlanConfig(model="llama-3.1-70b", contexts="128K", gpus=2, pnms=8))
    assert {r.provenance for r in got} == {"projected"} and {r.name for r in got} == {"plan"}
    batch = {r.params["where"]: r.value for r in got if r.metric == "max_batch"}
    assert batch["pnm-kv"] == 96 and batch == {
        k: v for k, v in max_batch(get_spec("llama-3.1-70b"), 128 * K, PlanConfig(
            model="llama-3.1-70b", gpus=2, pnms=8)).items() if k in batch}
    cost = {(r.params["device"], r.params.get("where")): r.value for r in got
            if r.metric != "max_batch"}
    assert cost[("a100-80gb", None)] == 400 and cost[("cxl-pnm", None)] == 150
    assert cost[("a100-80gb", "operating")] == pytest.approx(0.4 * 0.181)
    assert cost[("cxl-pnm", "hardware")] == pytest.approx(7000 / (3 * 8760))
    assert cost[("configuration", "total")] == pytest.approx(
        2 * cost[("a100-80gb", "total")] + 8 * cost[("cxl-pnm", "total")])


def test_project_only_writes_the_derived_plans_and_refuses_a_missing_source(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plan.jsonl"
    path = tmp_path / "p.toml"
    path.write_text(f'[experiment]\nname = "p"\nrecords = ["{out}"]\n[[derive]]\n'
                    f'function = "kvbench.plan:derived"\nout = "{out}"\nargs = {{ configs = '
                    '[{ model = "llama-3.1-8b", contexts = "128K", pnms = 8 }] }\n')
    assert cli(["experiment", "run", str(path), "--project-only"], capsys).returncode == 0
    exp = experiment.load_experiment(path)
    assert [json.loads(x)["metric"] for x in out.read_text().splitlines()[1:4]] == [
        "max_batch"] * 3
    gone = dataclasses.replace(exp, projections=(proj(source=tmp_path / "none.jsonl"),))
    with pytest.raises(KvbenchError, match=r"projection input '.*none\.jsonl' does not exist"):
        experiment.project(gone)
    path.write_text(path.read_text().replace("pnms = 8", "colour = 1"))
    assert_usage_error(cli(["experiment", "run", str(path), "--project-only"], capsys),
                       "plan config 1: PlanConfig.__init__() got an unexpected keyword")


@pytest.mark.parametrize(("body", "message"), [
    ('batch = "max"', 'projection 1: batch "max" needs budget_ratio'),
    ("colour = 1", "projection 1: unknown key 'colour'"),
    ("source_where = 256", r"projection 1: source_where: a table of parameters and values"),
    ("source_where = { budget_tokens = [256] }", r"projection 1: source_where: a table of "
                                                 r"parameters and values"),
    ('source = "results/nope.jsonl"', "'results/nope.jsonl' does not exist and no "
                                      "suite of the experiment writes it"),
])
def test_bad_projections_are_refused(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text('[experiment]\nname = "p"\nrecords = ["x.jsonl"]\n[projection_defaults]\n'
                    'source = "results/hgca-fig12/source.jsonl"\nout = "x.jsonl"\n'
                    f'hardware = "a100-pnm"\n[[projection]]\n{body}\n')
    with pytest.raises(KvbenchError, match=message):
        experiment.load_experiment(path)
