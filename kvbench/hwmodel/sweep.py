"""Projection sweeps: an experiment's `[[projection]]`, `kvbench project` at every point.

A `Projection` re-times the trace of every source run (kvbench.hwmodel.project) on each
profile of `hardware` at every point of its swept settings (`model`, `batch`, `prompt_len`,
`gen_len`, `bookkeeping`, and the device counts `gpus`, `pnms`: the profile replicated,
kvbench.hwmodel.profile.replicate). `batch = "max"` takes, per strategy, the largest batch
its configuration fits (kvbench.plan.max_batch with T_Budget = `budget_ratio` x context;
the configuration named like the strategy, or `plan_config`), times `batch_scale`. When the
source holds several runs of one strategy that differ in `steady_ratio` (PnG-KV's share
of the budget kept steady on the GPU), a point takes the run nearest the paper's ratio
#GPU / (#GPU + #PNM) (CXL-PNM section 3.3, Alg. 1 line 7). `source_where` keeps the source
runs whose parameters hold those values (e.g. the run at the budget share a target length
should carry over, kvbench.hwmodel.scale). `tag` parameters mark every
record (e.g. the figure it feeds); `breakdown` adds busy seconds per decode step by
resource and op (`busy_seconds_per_step`, `where` = "resource:op"). Every record is
provenance "projected".
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.errors import require
from kvbench.schema import Record

SWEPT = ("model", "batch", "prompt_len", "gen_len", "bookkeeping", "gpus", "pnms")
# parameters the projected records carry beside the source run's (tables may name them)
RECORD_PARAMS = ("hardware", "bookkeeping", "gpus", "pnms", "fits", "t_budget", "t_steady")


@dataclass(frozen=True)
class Projection:
    """`kvbench project SOURCE --hardware H...` at every point of the swept settings."""

    source: Path
    out: Path
    hardware: tuple[str, ...]
    sweep: dict[str, tuple[Any, ...]]  # SWEPT names -> values
    dtype: str = "float16"
    memory: str = "pinned"
    probes: tuple[Path, ...] = ()  # probe records hardware 'this' is built from (--probes)
    strategies: tuple[str, ...] = ()  # the source runs of these strategies only (): all
    source_where: dict[str, Any] = field(default_factory=dict)  # and of these parameters
    budget_ratio: float = 0.0  # batch "max": T_Budget / context
    plan_config: str = ""  # batch "max": kvbench.plan's configuration ("": the strategy's)
    batch_scale: float = 1.0
    skip: int = 0  # decode steps left out of the metrics
    breakdown: bool = False
    tag: dict[str, Any] = field(default_factory=dict)

    def points(self) -> list[dict[str, Any]]:
        keys = list(self.sweep)
        return [dict(zip(keys, p, strict=True))
                for p in itertools.product(*(self.sweep[k] for k in keys))]


def _groups(src: list[dict[str, Any]], label: str, names: tuple[str, ...],
            where: dict[str, Any]) -> dict[str, list[list[dict[str, Any]]]]:
    """strategy -> the trace records of its source runs whose parameters hold `where`."""
    from kvbench.hwmodel.project import runs

    out: dict[str, list[list[dict[str, Any]]]] = defaultdict(list)
    for key, recs in runs(src, label).items():
        params = recs[0]["params"]
        if (not names or key[0] in names) and all(k in params and params[k] == v
                                                   for k, v in where.items()):
            out[key[0]].append(recs)
    for name in names:
        require(name in out, f"{label}: no run of '{name}' to project"
                + (f" where {where}" if where else ""))
    require(bool(out), f"{label}: no run to project" + (f" where {where}" if where else ""))
    return out


def _chosen(runs: list[list[dict[str, Any]]], gpus: int | None, pnms: int | None
            ) -> list[list[dict[str, Any]]]:
    """Every run, or at a PNM count the one whose steady_ratio is nearest the paper's."""
    ratios = {r[0]["params"].get("steady_ratio") for r in runs}
    if not pnms or len(ratios) < 2:
        return runs
    want = (gpus or 1) / ((gpus or 1) + pnms)
    return [min(runs, key=lambda r: abs(float(r[0]["params"].get("steady_ratio", 0)) - want))]


def _batch(proj: Projection, name: str, point: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The point's batch for `name` and the plan's figures behind it (batch "max")."""
    if point.get("batch", 1) != "max":
        return int(point.get("batch", 1)), {}
    from kvbench.models import get_spec
    from kvbench.plan import PlanConfig, max_batch

    gpus, pnms = point.get("gpus", 1), point.get("pnms", 0)
    got = max_batch(get_spec(point["model"]), point["prompt_len"],
                    PlanConfig(model=point["model"], gpus=gpus, pnms=pnms,
                               budget_ratio=proj.budget_ratio))
    config = proj.plan_config or name
    require(config in got, f"projection: no plan configuration '{config}' (set plan_config)")
    fits = int(got[config] * proj.batch_scale)
    return fits, {"t_budget": got["t_budget"], "fits": fits,
                  "t_steady": got["t_steady"] if config == "png-kv" else 0}


def records(proj: Projection, label: str) -> list[Record]:
    """Every point's projected records (nothing written)."""
    from kvbench.hwmodel.cli import projected, target_shape
    from kvbench.schema import not_measured
    from kvbench.store import load

    groups = _groups(load(proj.source).records, label, proj.strategies,
                     proj.source_where)
    out: list[Record] = []
    for point in proj.points():
        gpus, pnms = point.get("gpus"), point.get("pnms")
        for name, recs in ((n, x) for n, runs in groups.items()
                           for x in _chosen(runs, gpus, pnms)):
            batch, plan = _batch(proj, name, point)
            tag = {**proj.tag, **({"gpus": gpus} if gpus is not None else {}),
                   **({"pnms": pnms} if pnms is not None else {}), **plan}
            if batch < 1:
                r = not_measured("run", name, "decode_tokens_per_s", "waived",
                                 "no sequence fits", {"model": point["model"],
                                                      "prompt_len": point["prompt_len"], **tag})
                r.provenance = "projected"
                out.append(r)
                continue
            target = target_shape(point.get("model"), batch, point.get("prompt_len", 1920),
                                  point.get("gen_len", 128), proj.dtype) \
                if "model" in point else None
            carried = point.get("bookkeeping", "measured") == "measured"
            got, _ = projected(recs, label, list(proj.hardware), list(proj.probes),
                               proj.memory, target, carried, gpus, pnms, proj.skip)
            for r in got:
                r.params.update(tag)
            out += got
            if proj.breakdown:
                out += _busy(proj, recs, target, carried, gpus, pnms, tag)
    return out


def _busy(proj: Projection, recs: list[dict[str, Any]], target: Any, carried: bool,
          gpus: int | None, pnms: int | None, tag: dict[str, Any]) -> list[Record]:
    """Busy seconds per decode step of each resource:op on each profile (Fig. 13-style)."""
    from kvbench.hwmodel.cli import profile_at
    from kvbench.hwmodel.project import project_run
    from kvbench.schema import measured

    out = []
    for h in proj.hardware:
        prof = profile_at(h, list(proj.probes), recs, target.spec if target else None, gpus,
                          pnms)
        _, dec = project_run(recs, prof, proj.memory, target, carried, proj.skip)
        for op in sorted({k for s in dec for k in s.ops}):
            r = measured("run", recs[0]["name"], "busy_seconds_per_step", "s", "none",
                         [s.ops.get(op, 0.0) for s in dec],
                         {"model": target.spec.name if target else "", "prompt_len":
                          target.prompt if target else 0, "batch": target.batch
                          if target else 1, "where": op, "hardware": prof.name, **tag},
                         {"model": "kvbench.hwmodel.schedule",
                          "source_run": recs[0].get("command", "")})
            r.provenance = "projected"
            out.append(r)
    return out
