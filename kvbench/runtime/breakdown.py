"""Per-run figures derived from the work trace (issue 6: what a run reports).

From the per-(step, layer) counters of the decode steps, for every strategy: bytes moved
per link per step, tokens attended per device, step, layer and sequence (mean over layers
and the batch), the share of decode time the accelerator role waited for the host or a
transfer (`accel_idle`), the share spent in the strategy's bookkeeping (every
"bookkeeping.*" phase, including worker-thread time filed by the strategy) and, in eval
mode, the attention output's relative error against full attention and the share of its
top-10 keys attended (kvbench.runtime.shadow), median and mean over layers and the worst
layer (`SHARED`). A strategy's own figures (pages recalled per step, the host's share of
the budget, ...) are the `Metric`s its class declares (`Strategy.metrics`), derived here by
their `reduction`. Shares are of the summed decode step time, so they are ratios within one
run, robust to a noisy shared machine.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvbench.schema import Direction, ParamValue, Record, measured, not_measured

REDUCTIONS = ("trace", "step", "step_mean", "layer", "own")
PerLayer = dict[tuple[str, str, int], list[float]]


@dataclass(frozen=True)
class Metric:
    """A figure a strategy reports, declared on its class (`Strategy.metrics`): record
    `name` in `unit` with `direction`, derived by `reduction` from the decode steps' values
    of counter `of` (what the strategy counts with `counters.add(of, where, value)`;
    default: `name`). `unit` is also the unit of the counter's trace.{of} records, unless
    `of` is a quantity every strategy shares (kvbench.runtime.context.UNITS).

    reduction: "trace": no figure beyond the trace.{of} records (per step, layer, where);
    "step": per decode step, summed over layers, and "step_mean": that over the number of
    layers that count it, one record per `where` (which replaces "{where}" in `name`) with
    method "per" `per`; "layer": per layer the mean over decode steps (median over layers,
    mean and worst layer by `direction` in the method), waived with reason `random` in a
    run with random weights when given; "own": `derive(name, params, per_layer)` yields the
    records from {(quantity, where, layer): decode-step values}.
    """

    name: str
    unit: str
    direction: Direction = "none"
    reduction: str = "trace"
    of: str = ""
    per: str = ""
    random: str = ""
    derive: Callable[[str, dict[str, ParamValue], PerLayer], Iterator[Record]] | None = None

    def __post_init__(self) -> None:
        if (self.reduction not in REDUCTIONS or self.direction not in ("lower", "higher", "none")
                or (self.reduction == "own") != (self.derive is not None)):
            raise ValueError(f"metric {self.name!r}: reduction one of {REDUCTIONS} (derive "
                             f"given exactly for 'own'), direction lower, higher or none")

    @property
    def counter(self) -> str:
        """The counted quantity the figure derives from."""
        return self.of or self.name


# figures of the quantities every strategy's run counts (the shadow's, in eval mode)
SHARED = (Metric("attention_rel_error", "ratio", "lower", "layer", of="rel_error"),
          Metric("top10_recall", "ratio", "higher", "layer", of="topk_recall"))


def derived(name: str, params: dict[str, ParamValue], steps: list[float],
            counters: Any) -> Iterator[Record]:
    """Records of the decode-phase breakdown; `steps` are the decode step seconds. A counted
    quantity neither shared nor declared in `counters.metrics` is an error (Counters.unit)."""
    n = len(steps)
    total = sum(steps)
    per_step: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0] * n)
    per_layer: PerLayer = {}
    for quantity, where, layer, series in counters.series():
        counters.unit(quantity)
        values = [series.get(s, 0.0) for s in range(1, n + 1)]
        per_layer[(quantity, where, layer)] = values
        acc = per_step[(quantity, where)]
        for i, v in enumerate(values):
            acc[i] += v
    own: tuple[Metric, ...] = counters.metrics
    method = {"per": "decode step, summed over layers", "statistic": "median"}
    for (quantity, where), v in sorted(per_step.items()):
        if quantity == "bytes_moved":
            yield measured("run", name, "bytes_moved_per_step", "B", "none", v,
                           {**params, "where": where}, method)
        elif quantity == "tokens" and where in ("accel", "host", "pnm"):
            layers, batch = int(params["layers"]), int(params["batch"])  # type: ignore[arg-type]
            yield measured("run", name, "tokens_attended_per_step", "tokens/layer", "none",
                           [x / (layers * batch) for x in v], {**params, "where": where},
                           {"per": f"decode step: tokens attended per layer and sequence, "
                                   f"mean over the run's {layers} layers and {batch} sequences",
                            "statistic": "median"})
        for m in own:
            if m.counter == quantity and m.reduction in ("step", "step_mean"):
                count = sum(1 for (q, w, _) in per_layer if (q, w) == (quantity, where))
                yield measured("run", name, m.name.replace("{where}", where), m.unit,
                               m.direction, [x / count for x in v]
                               if m.reduction == "step_mean" else v, params,
                               {**method, "per": m.per})
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
    for m in own:
        if m.derive is not None:
            yield from m.derive(name, params, per_layer)
    for m in (*SHARED, *own):
        if m.reduction == "layer":
            yield from _by_layer(m, name, params, per_layer)


def _by_layer(m: Metric, name: str, params: dict[str, ParamValue],
              per_layer: PerLayer) -> Iterator[Record]:
    """Reduction "layer": per layer the mean over decode steps."""
    by_layer = {layer: statistics.fmean(v) for (q, _, layer), v in per_layer.items()
                if q == m.counter and v}
    if by_layer and m.random and params.get("weights") == "random":
        yield not_measured("run", name, m.name, "waived", m.random, params)
    elif by_layer:
        worst = (max if m.direction == "lower" else min)(by_layer, key=by_layer.__getitem__)
        yield measured("run", name, m.name, m.unit, m.direction, list(by_layer.values()),
                       params,
                       {"statistic": "median over layers of the mean over decode steps",
                        "mean": statistics.fmean(by_layer.values()), "worst_layer": worst,
                        "worst": by_layer[worst]})
