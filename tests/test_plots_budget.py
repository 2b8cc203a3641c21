"""Accuracy-vs-attended-tokens figures: points pair each run's metric with its own measured
tokens attended, strategies with different budget options share one figure."""

from __future__ import annotations

from pathlib import Path

from kvbench.plots.budget import attended_points, budget_figures
from kvbench.schema import measured


def _run(name: str, own: dict, tokens: float, ppl: float) -> list[dict]:
    params = {"model": "m", "mode": "eval", "prompt_len": 1, "gen_len": 511, **own}
    return [measured("run", name, "tokens_attended_per_step", "tokens/layer", "none",
                     [tokens], {**params, "where": "accel"}).to_dict(),
            measured("run", name, "perplexity", "ppl", "lower", [ppl], params).to_dict()]


def test_points_pair_metric_with_attended_tokens(tmp_path: Path) -> None:
    recs = (_run("full", {}, 256, 10.0) + _run("quest", {"budget_tokens": 32}, 40.5, 12.0)
            + _run("quest", {"budget_tokens": 64}, 70.0, 11.0)
            + _run("h2o", {"gpu_tokens": 64}, 64.0, 13.0)
            + _run("h2o", {"gpu_tokens": 64, "prompt_len": 9}, 64.0, 99.0))
    pts = attended_points(recs, "perplexity")
    quest = [p for (n, s), p in pts.items() if n == "quest"]
    assert sorted(quest[0]) == [(40.5, 12.0), (70.0, 11.0)]
    assert len([k for k in pts if k[0] == "h2o"]) == 2  # another prompt: another setting
    figs = budget_figures(recs, tmp_path)
    assert len(figs) == 1 and figs[0][1].stat().st_size > 1000  # one shared setting drawn
