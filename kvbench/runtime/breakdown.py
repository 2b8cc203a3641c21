"""Per-run figures derived from the work trace (issue 6: what a run reports).

From the per-(step, layer) counters of the decode steps: bytes moved per link per step,
pages recalled and evicted per step (page strategies), tokens attended per device, step,
layer and sequence (mean over layers and the batch), the share of decode time the
accelerator role waited for the host or a transfer (`accel_idle`), the share spent in the
strategy's bookkeeping (every "bookkeeping.*" phase, including worker-thread time filed by
the strategy), the selected fraction of host-resident entries per KV head (strategies that
count "host_selected.h*" and "host_resident" tokens: hgca) and, in eval mode, the
attention output's relative error against full attention and the share of its top-10 keys
attended (kvbench.runtime.shadow), median and mean over layers and the worst layer.
Shares are of the summed decode step time, so they are ratios within one run, robust to a
noisy shared machine.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from kvbench.schema import ParamValue, Record, measured, not_measured


def derived(name: str, params: dict[str, ParamValue], steps: list[float],
            counters: Any) -> Iterator[Record]:
    """Records of the decode-phase breakdown; `steps` are the decode step seconds."""
    n = len(steps)
    total = sum(steps)
    per_step: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0] * n)
    per_layer: dict[tuple[str, str, int], list[float]] = {}
    for quantity, where, layer, series in counters.series():
        values = [series.get(s, 0.0) for s in range(1, n + 1)]
        per_layer[(quantity, where, layer)] = values
        acc = per_step[(quantity, where)]
        for i, v in enumerate(values):
            acc[i] += v
    method = {"per": "decode step, summed over layers", "statistic": "median"}
    for (quantity, where), v in sorted(per_step.items()):
        if quantity == "bytes_moved":
            yield measured("run", name, "bytes_moved_per_step", "B", "none", v,
                           {**params, "where": where}, method)
        elif quantity == "pages":  # page strategies' resident-set changes (arkvale)
            yield measured("run", name, f"pages_{where}_per_step", "pages", "none", v,
                           params, {**method, "per": "decode step: pages summed over "
                                    "layers, sequences and KV heads"})
        elif quantity == "cpu_ratio":  # scout: host tokens / budget, per sparse layer
            n_layers = sum(1 for (q, w, _) in per_layer if (q, w) == (quantity, where))
            yield measured("run", name, "cpu_compute_ratio_per_step", "ratio", "lower",
                           [x / n_layers for x in v], params,
                           {**method, "per": "decode step: tokens attended on the host / "
                                   "budget, mean over the layers that report it"})
        elif quantity == "tokens" and where in ("accel", "host", "pnm"):
            layers, batch = int(params["layers"]), int(params["batch"])  # type: ignore[arg-type]
            yield measured("run", name, "tokens_attended_per_step", "tokens/layer", "none",
                           [x / (layers * batch) for x in v], {**params, "where": where},
                           {"per": f"decode step: tokens attended per layer and sequence, "
                                   f"mean over the run's {layers} layers and {batch} sequences",
                            "statistic": "median"})
    share = {"per": "sum over decode steps / sum of decode step times"}
    times = {w: sum(v) for (q, w), v in per_step.items() if q == "time"}
    if total > 0 and "accel_idle" in times:
        yield measured("run", name, "accel_idle_share", "ratio", "lower",
                       [times["accel_idle"] / total], params, share)
    book = {w: t for w, t in times.items() if w.startswith("bookkeeping.")}
    if total > 0 and book:
        yield measured("run", name, "bookkeeping_share", "ratio", "lower",
                       [sum(book.values()) / total], params,
                       {**share, "phases": {w: t / total for w, t in sorted(book.items())}})
    yield from _selected(name, params, per_layer)
    for quantity, metric, direction, worst_of in (
            ("rel_error", "attention_rel_error", "lower", max),
            ("topk_recall", "top10_recall", "higher", min),
            ("q_cosine", "query_cosine", "higher", min),
            ("pred_error", "predicted_query_rel_error", "lower", max),
            ("pred_overlap", "predicted_block_overlap", "higher", min)):
        by_layer = {layer: statistics.fmean(v) for (q, _, layer), v in per_layer.items()
                    if q == quantity and v}
        if by_layer and quantity == "q_cosine" and params.get("weights") == "random":
            yield not_measured("run", name, metric, "waived", "random weights: the predicted "
                               "query's cosine is meaningless", params)
        elif by_layer:
            worst = worst_of(by_layer, key=by_layer.__getitem__)
            yield measured("run", name, metric, "ratio", direction, list(by_layer.values()),
                           params,
                           {"statistic": "median over layers of the mean over decode steps",
                            "mean": statistics.fmean(by_layer.values()), "worst_layer": worst,
                            "worst": by_layer[worst]})


def _selected(name: str, params: dict[str, ParamValue],
              per_layer: dict[tuple[str, str, int], list[float]]) -> Iterator[Record]:
    """Selected share of host entries per (layer, KV head), summed over decode steps."""
    resident = {layer: sum(v) for (q, w, layer), v in per_layer.items()
                if q == "tokens" and w == "host_resident"}
    fractions = [sum(v) / resident[layer] for (q, w, layer), v in sorted(per_layer.items())
                 if q == "tokens" and w.startswith("host_selected.") and resident.get(layer)]
    if fractions:
        yield measured("run", name, "selected_fraction", "ratio", "none", fractions, params,
                       {"per": "(layer, KV head): selected / host-resident entries",
                        "statistic": "median", "min": min(fractions), "max": max(fractions)})
