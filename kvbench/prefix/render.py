"""The end-of-run table of a prefix-cache run: per turn and path, TTFT = copy + compute."""

from __future__ import annotations

from kvbench.schema import Record
from kvbench.units import format_bytes, format_seconds


def turn_table(recs: list[Record]) -> None:
    """Print per turn: recompute / load / resident TTFT medians split into copy and compute,
    the tokens and bytes loaded and the load path's logits against recompute."""
    from rich.table import Table

    from kvbench.console import console

    by = {(r.metric, r.params.get("turn"), r.params.get("path")): r for r in recs
          if r.metric.startswith("prefix_") and r.status == "ok"}
    run = next((r for r in recs if r.metric == "prefix_hits"), None)
    tier = run.method.get("tier", "") if run else ""
    t = Table(title=f"prefix cache on {tier}: TTFT of each later turn's request (median)")
    for col in ("turn", "path", "prefix tok", "request tok", "TTFT", "copy", "compute",
                "loaded", "logits vs recompute"):
        t.add_column(col)
    for turn in sorted({k[1] for k in by if k[0] == "prefix_ttft"}):
        for path in ("recompute", "load", "resident"):
            r = by[("prefix_ttft", turn, path)]
            extra, diff = "", ""
            if path == "load":
                extra = format_bytes(by[("prefix_bytes_loaded", turn, "load")].value)
                d = by[("prefix_logits_max_abs_diff", turn, "load")]
                diff = (f"max |d| {d.value:.2g}, argmax {d.method['argmax_agree']:.0%}, "
                        f"{'bitwise = resident' if d.method['bitwise_equal_resident'] else '-'}")
            t.add_row(str(turn), path, str(r.params["prefix_tokens"]),
                      str(r.params["request_tokens"]), format_seconds(r.value),
                      format_seconds(by[("prefix_ttft_copy", turn, path)].value),
                      format_seconds(by[("prefix_ttft_compute", turn, path)].value), extra, diff)
    console.print(t)
    if run is not None:
        m = {r.metric: r.value for r in recs if r.metric in (
            "prefix_hits", "prefix_misses", "prefix_evictions", "prefix_saves")}
        console.print(f"prefix cache: {run.method['placement']}; chunks hit "
                      f"{m['prefix_hits']:.0f}, missed {m['prefix_misses']:.0f} over "
                      f"{run.method['lookups']} lookups; "
                      f"{m['prefix_saves']:.0f} saves, {m['prefix_evictions']:.0f} evictions")
