"""Plots of the attention probe's records: HGCA Fig. 10 (hybrid speedup over gpu-transfer
versus tokens on the GPU and the host) and Fig. 11 (time breakdown per mode)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Fig. 10 (hybrid speedup over gpu-transfer vs tokens on GPU/host) and Fig. 11
    (stacked time breakdown per mode at the smallest GPU window), where data exist."""
    ok = [r for r in records if r["status"] == "ok" and r["metric"].startswith("time")]
    return [p for p in (_heatmap(ok, out_dir), _breakdown(ok, out_dir)) if p]


_SHAPE = ("batch", "heads", "kv_heads", "head_dim", "query", "dtype")


def _panel(r: dict[str, Any]) -> str:
    return " ".join(f"{k}={r['params'][k]}" for k in _SHAPE)


def _heatmap(recs: list[dict[str, Any]], out_dir: Path) -> Path | None:
    from kvbench.plots import pyplot, save

    times: dict[tuple[str, int, int, str], float] = {}
    for r in recs:
        if r["metric"] == "time" and r["params"]["mode"] in ("hybrid", "gpu-transfer"):
            pr = r["params"]
            times[(_panel(r), pr["gpu_tokens"], pr["host_tokens"], pr["mode"])] = r["value"]
    cells = {k[:3]: times[(*k[:3], "gpu-transfer")] / v for k, v in times.items()
             if k[3] == "hybrid" and (*k[:3], "gpu-transfer") in times}
    if not cells:
        return None
    panels = sorted({k[0] for k in cells})
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        gs = sorted({k[1] for k in cells if k[0] == panel})
        hs = sorted({k[2] for k in cells if k[0] == panel})
        grid_ = [[cells.get((panel, g, h), float("nan")) for h in hs] for g in gs]
        im = ax.imshow(grid_, origin="lower", cmap="coolwarm", aspect="auto")
        for i, row in enumerate(grid_):
            for j, val in enumerate(row):
                ax.text(j, i, f"{val:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(hs)), [str(h) for h in hs])
        ax.set_yticks(range(len(gs)), [str(g) for g in gs])
        ax.set_xlabel("KV tokens on host")
        ax.set_ylabel("KV tokens on GPU")
        ax.set_title(panel, fontsize=8)
        fig.colorbar(im, ax=ax, label="hybrid speedup over gpu-transfer")
    return save(fig, out_dir / "attention-fig10-hybrid-speedup.png")


def _breakdown(recs: list[dict[str, Any]], out_dir: Path) -> Path | None:
    from kvbench.plots import pyplot, save

    parts = [r for r in recs if r["metric"].startswith("time_")]
    if not parts:
        return None
    panel = _panel(parts[0])
    window = min(r["params"]["gpu_tokens"] for r in parts if _panel(r) == panel)
    bars: dict[tuple[int, str], dict[str, float]] = {}
    for r in parts:
        if _panel(r) == panel and r["params"]["gpu_tokens"] == window:
            key = (r["params"]["host_tokens"], r["params"]["mode"])
            bars.setdefault(key, {})[r["metric"][5:]] = r["value"]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(bars)), 4))
    colours = {"transfer": "tab:red", "gpu": "tab:green", "cpu": "tab:blue", "merge": "tab:orange"}
    labels = []
    for x, (key, comp) in enumerate(sorted(bars.items())):
        bottom = 0.0
        for name, colour in colours.items():
            if name in comp:
                ax.bar(x, comp[name] * 1e3, bottom=bottom, color=colour,
                       label=name if name not in ax.get_legend_handles_labels()[1] else None)
                bottom += comp[name] * 1e3
        labels.append(f"{key[1]}\nhost={key[0]}")
    ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=45, ha="right")
    ax.set_ylabel("time per step (ms; parts timed alone)")
    ax.set_title(f"{panel} gpu_tokens={window}", fontsize=8)
    ax.legend()
    return save(fig, out_dir / "attention-fig11-breakdown.png")
