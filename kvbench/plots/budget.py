"""Accuracy against the tokens a strategy actually attended (issue 12's experiments).

Every accuracy metric of a run (perplexity, top-10 recall, passkey accuracy) is drawn
against the same run's measured `tokens_attended_per_step` (per layer and sequence, both
devices summed), one line per strategy, full attention as the reference line. Comparing at
equal attended tokens is what makes strategies with different budget options (--budget-
tokens, --gpu-tokens) and dense layers comparable. ArkVale-style strategies also get their
page recalls per layer over the decode steps (CXL-PNM Fig. 3a counts).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from kvbench.plots import pyplot, save
from kvbench.summary import REFERENCE

METRICS = {"perplexity": "lower", "top10_recall": "higher", "passkey_accuracy": "higher"}
# run options every strategy shares (RunConfig fields): what a comparison holds fixed
_SHARED = ("model", "weights", "layers", "batch", "prompt_len", "gen_len", "turns", "mode",
           "dtype", "text", "depth")


def _key(params: dict[str, Any], drop: tuple[str, ...] = ()) -> tuple:
    return tuple(sorted((k, v) for k, v in params.items() if k not in drop and k != "where"))


def attended_points(records: list[dict[str, Any]], metric: str
                    ) -> dict[tuple[str, tuple], list[tuple[float, float]]]:
    """(strategy, setting) -> [(tokens attended per step and layer, metric value)], where
    the setting is the run's parameters minus the strategy's own (budget included)."""
    tokens: dict[tuple[str, tuple], float] = defaultdict(float)
    for r in records:
        if r["metric"] == "tokens_attended_per_step" and r["status"] == "ok":
            tokens[(r["name"], _key(r["params"]))] += r["value"]
    series: dict[tuple[str, tuple], list[tuple[float, float]]] = defaultdict(list)
    for r in records:
        if r["metric"] != metric or r["status"] != "ok":
            continue
        t = tokens.get((r["name"], _key(r["params"])))
        if t is None:
            continue
        shared = {k: v for k, v in r["params"].items() if k in _SHARED}
        series[(r["name"], _key(shared))].append((t, r["value"]))
    return series



def budget_figures(records: list[dict[str, Any]], out_dir: Path) -> list[tuple[str, Path]]:
    """(title, png) per accuracy metric and shared setting with two or more strategies."""
    plt = pyplot()
    out = []
    for metric, better in METRICS.items():
        series = attended_points(records, metric)
        settings = sorted({s for _, s in series}, key=str)
        for i, setting in enumerate(settings):
            lines = {n: sorted(p) for (n, s), p in series.items() if s == setting}
            if len(lines) < 2:
                continue
            fig, ax = plt.subplots(figsize=(6.4, 4))
            for name, pts in sorted(lines.items()):
                xs, ys = zip(*pts, strict=True)
                if name == REFERENCE:
                    ax.axhline(ys[0], color="black", ls=":", label=f"{name} ({xs[0]:.0f})")
                else:
                    ax.plot(xs, ys, marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens attended per step and layer (measured)")
            ax.set_ylabel(f"{metric} ({better} is better)")
            ax.set_title(f"{metric} vs attended tokens: "
                         + ", ".join(f"{k}={v}" for k, v in setting if k in (
                             "mode", "prompt_len", "gen_len", "depth", "batch")), fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
            path = save(fig, out_dir / f"budget-{metric}-{i}.png")
            out.append((f"runs: {metric} against tokens attended", path))
    out += recall_figures(records, out_dir)
    return out


def recall_figures(records: list[dict[str, Any]], out_dir: Path) -> list[tuple[str, Path]]:
    """Pages recalled per decode step, one line per layer (running mean over 16 steps)."""
    plt = pyplot()
    runs: dict[tuple, dict[int, list[float]]] = defaultdict(dict)
    for r in records:
        p = r["params"]
        if r["metric"] == "trace.pages" and p.get("where") == "recalled" \
                and p.get("phase") == "decode" and r["status"] == "ok":
            rest = _key(p, ("layer", "phase"))
            runs[(r["name"], rest)][int(p["layer"])] = r["samples"]
    out = []
    for i, ((name, rest), layers) in enumerate(sorted(runs.items(), key=str)):
        if not any(any(v) for v in layers.values()):
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4))
        cmap = plt.get_cmap("viridis")
        top = max(layers) or 1
        for layer, s in sorted(layers.items()):
            w = 16
            mean = [sum(s[max(0, j - w + 1):j + 1]) / len(s[max(0, j - w + 1):j + 1])
                    for j in range(len(s))]
            ax.plot(range(1, len(s) + 1), mean, color=cmap(layer / top), lw=1,
                    label=f"layer {layer}" if layer in (min(layers), top) else None)
        params = dict(rest)
        ax.set_xlabel("decode step (context = prompt + step)")
        ax.set_ylabel("pages recalled per step (all rows, KV heads)")
        ax.set_title(f"{name}: recalls per layer, budget {params.get('budget_tokens')} "
                     f"tokens, page {params.get('page_size')}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        path = save(fig, out_dir / f"recalls-{name}-{i}.png")
        out.append((f"runs: {name} page recalls per layer", path))
    return out
