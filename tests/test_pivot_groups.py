"""Pivots over configurations (kvbench.present.pivot): composite columns, a reference per
group of rows, the mean row, an extra over later steps, "-" for an absent parameter and
per-metric reductions; each figure computed here by hand."""

from __future__ import annotations

import pytest

from kvbench.errors import KvbenchError
from kvbench.present.pivot import Extra, Pivot
from kvbench.present.table import Table


def rec(name: str, metric: str, value: float, samples: list[float] | None = None,
        **params: object) -> dict:
    samples = samples or [value]
    return {"kind": "run", "name": name, "metric": metric, "value": value, "status": "ok",
            "params": dict(params), "samples": samples,
            "stats": {"mean": sum(samples) / len(samples)}}


# a baseline per GPU count (#PNM 0) and two strategies at 1 and 2 PNMs per GPU
TPS = [rec("arkvale", "tps", 100.0, gpus=1, pnms=0), rec("arkvale", "tps", 150.0, gpus=2, pnms=0),
       rec("pnm-kv", "tps", 120.0, gpus=1, pnms=1), rec("png-kv", "tps", 90.0, gpus=1, pnms=1),
       rec("pnm-kv", "tps", 300.0, gpus=2, pnms=2), rec("png-kv", "tps", 330.0, gpus=2, pnms=2)]
GROUPED = Pivot(title="g", metric="tps", rows=("gpus", "pnms"), columns="name", fmt=".0f",
                every_key=True, reference={"name": "arkvale"}, reference_by=("gpus",),
                ratios=(("png-kv", "pnm-kv"),), summary=True)


def test_each_cell_is_compared_with_the_reference_of_its_group() -> None:
    heads, rows = Table(GROUPED, TPS, {}).grid()
    assert heads == ["gpus / pnms", "name arkvale", "name png-kv", "name pnm-kv",
                     "png-kv / pnm-kv"]
    assert rows[:4] == [["1 / 0", "100", "-", "-", "-"],
                        ["1 / 1", "-", "90 (-10.0%)", "120 (+20.0%)", "0.75x"],
                        ["2 / 0", "150", "-", "-", "-"],
                        ["2 / 2", "-", "330 (+120.0%)", "300 (+100.0%)", "1.10x"]]
    # the mean row: (0.9 + 2.2) / 2, (1.2 + 2.0) / 2, (0.75 + 1.1) / 2; the baseline column
    # has no reference of its own
    assert rows[4] == ["mean over rows (vs gpus reference)", "-", "1.55x", "1.60x", "0.93x"]


def test_an_empty_reference_by_serves_every_cell_and_keeps_its_row() -> None:
    pivot = Pivot(title="g", metric="tps", rows=("gpus", "pnms"), columns="name", fmt=".0f",
                  every_key=True, reference={"name": "arkvale", "gpus": 1},
                  reference_by=(), summary=True)
    t = Table(pivot, TPS, {})
    _, rows = t.grid()
    assert rows[2] == ["2 / 0", "150 (+50.0%)", "-", "-"]
    assert rows[0] == ["1 / 0", "100", "-", "-"]  # the reference, unchanged, in its row
    assert rows[-1][0] == "mean over rows (vs the reference)"
    assert "Reference (" not in "\n".join(t.markdown())


def test_two_references_in_one_group_are_refused() -> None:
    recs = [*TPS, rec("arkvale", "tps", 99.0, gpus=1, pnms=0, batch=4)]
    with pytest.raises(KvbenchError, match=r"the reference \{'name': 'arkvale'\} matches two "
                                           r"runs at gpus \('1',\)"):
        Table(GROUPED, recs, {})


def test_composite_columns_label_each_combination() -> None:
    recs = [rec("arkvale", "pages", 1.0, layer=2), rec("png-kv", "pages", 2.0, layer=2,
                                                       devices=1),
            rec("png-kv", "pages", 3.0, layer=2, devices=8)]
    pivot = Pivot(title="c", metric="pages", rows=("layer",), columns=("name", "devices"),
                  fmt=".1f", change=False)
    heads, rows = Table(pivot, recs, {}).grid()
    assert heads == ["layer", "name / devices arkvale / -", "name / devices png-kv / 1",
                     "name / devices png-kv / 8"]
    assert rows == [["2", "1.0", "2.0", "3.0"]]


def test_a_dash_in_a_filter_matches_an_absent_parameter() -> None:
    recs = [rec("full", "ppl", 10.0), rec("quest", "ppl", 12.0, budget_tokens=64),
            rec("quest", "ppl", 11.0, budget_tokens=128)]
    pivot = Pivot(title="d", metric="ppl", rows=("name",), columns="metric", fmt=".1f",
                  where={"budget": [64, "-"]}, reference={"name": "full"})
    _, rows = Table(pivot, recs, {"budget": ("budget_tokens",)}).grid()
    assert rows == [["full", "10.0"], ["quest", "12.0 (+20.0%)"]]


def test_an_extra_can_leave_out_the_first_steps() -> None:
    recs = [rec("png-kv", "recalls", 3.0), *(
        rec("png-kv", "trace.pages", 0.0, samples=s, layer=i, where="recalled")
        for i, s in enumerate(([8.0, 1.0, 0.0, 2.0], [4.0, 0.0, 0.0, 1.0])))]
    pivot = Pivot(title="e", metric="recalls", rows=("name",), columns="metric", fmt=".1f",
                  change=False, extras=(
                      Extra("trace.pages", ".2f", "all ", sum_over="layer", statistic="mean"),
                      Extra("trace.pages", ".2f", "later ", sum_over="layer", skip=1)))
    _, rows = Table(pivot, recs, {}).grid()
    # all steps: 11/4 + 5/4 = 4.00; after step 1: 3/3 + 1/3 = 1.33
    assert rows == [["png-kv", "3.0, all 4.00, later 1.33"]]


def test_a_reduction_over_several_metrics_keeps_them_apart() -> None:
    recs = [rec("pnm-kv", m, 0.0, samples=s, layer=i, devices=3)
            for m, per in (("trace.topk_sorts", ([2.0, 4.0], [1.0, 1.0])),
                           ("trace.reductions", ([0.0, 2.0], [5.0, 5.0])))
            for i, s in enumerate(per)]
    pivot = Pivot(title="r", metric=("trace.topk_sorts", "trace.reductions"),
                  rows=("devices",), columns="metric", reduce="sum", fmt=".0f", change=False)
    _, rows = Table(pivot, recs, {}).grid()
    assert rows == [["3", "4", "6"]]  # 3 + 1 sorts, 1 + 5 reductions per step


def test_two_records_of_one_run_in_one_cell_are_refused() -> None:
    """A run's per-record split (here `where`) that the rows leave out would show one of
    its records silently; a pivot of several metrics counts each record once."""
    recs = [rec("h2o", "tokens", 60.0, where="accel"), rec("h2o", "tokens", 5.0, where="host")]
    pivot = Pivot(title="s", metric="tokens", rows=("name",), columns="metric")
    with pytest.raises(KvbenchError, match=r"two records of one run for one cell \(row 'h2o', "
                                           r"metric tokens\)"):
        Table(pivot, recs, {})
    both = Table(Pivot(title="m", metric=("tps", "ppl"), rows=("gpus",), columns="metric"),
                 [rec("full", "tps", 1.0, gpus=1), rec("full", "ppl", 9.0, gpus=1)], {})
    assert "Records: 1 runs, 2 records" in both.provenance()
