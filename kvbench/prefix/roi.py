"""The ROI model of the CXL KV-storage paper (appendix A.1, Table 1; section 3.4).

    C0 = 2 M L             FLOPs of an initial request's prefill (M parameters, L tokens)
    C1 = r C0              FLOPs of a follow-up's new prompt (r: its share of the tokens)
    P0 = C0 / T_slo        FLOP/s an initial request needs to meet the TTFT SLO
    P1 = C1 / (T_slo - T_load)   FLOP/s a follow-up needs once its prefix is loaded
    R_gpu = P / (P0 (1 - h) + P1 h)   requests/s per GPU of compute P, h = follow-up share
    N_cxl = ceil(R / R_gpu),  N_base = ceil(R / (P / P0))   GPUs for R requests/s

With the paper's inputs (P = 100 TFLOP/s, C0 = 25 TFLOP, r = 0.1, T_slo = 0.4 s,
T_load = 0.1 s) P0 = 62.5 TFLOP/s, 1.6 requests/s per GPU without the cache; P1 = 8.33
TFLOP/s, 12 with it: 7.5x, and 1 - 1/7.5 = 87% fewer GPUs. What the paper leaves unsaid
(wave-2 spec section 6; stated, not copied): those figures hold only at h = 1 (every
request a follow-up whose prefix is cached), the h that section 3.4 silently fixes; and
the abstract's "7.5x higher GPU utilization" is requests per second per GPU, not
utilization. Everything here is a projection (provenance "projected").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from kvbench.errors import require

PAPER_NOTES = (
    "the paper's 7.5x and 87% assume h = 1 (every request a follow-up with its prefix "
    "cached); section 3.4 fixes h = 1 without saying so, though Table 1 defines h",
    "the abstract calls the 7.5x 'GPU utilization'; it is requests per second per GPU at "
    "the same compute",
    "87% is the ratio 1 - R_base / R_gpu; with the ceilings of N_cxl and N_base at a "
    "given demand R the saving differs slightly (R = 100: 63 vs 9 GPUs, 85.7%)",
)


@dataclass(frozen=True)
class RoiInputs:
    """The model's inputs (paper's values as defaults), in SI units."""

    gpu_flops: float = 100e12  # P
    prefill_flops: float = 25e12  # C0
    new_ratio: float = 0.1  # r
    slo_s: float = 0.4  # T_slo
    load_s: float = 0.1  # T_load
    demand_rps: float = 100.0  # R

    def __post_init__(self) -> None:
        require(self.slo_s > 0, f"--slo {self.slo_s}: the TTFT SLO must be above 0 s")
        require(0 <= self.load_s < self.slo_s, f"--load-time {self.load_s} s: must be at "
                f"least 0 and below the SLO ({self.slo_s} s), which must leave time to "
                "compute the new prompt")
        require(0 < self.new_ratio <= 1, f"--new-ratio {self.new_ratio}: must be in (0, 1]")
        require(self.gpu_flops > 0 and self.prefill_flops > 0 and self.demand_rps > 0,
                "--gpu-tflops, --prefill-tflop and --demand must be above 0")


# the parameters of this module's records (kvbench.derive: tables may name them)
RECORD_PARAMS = ("h", "inputs", *(f.name for f in fields(RoiInputs)))


@dataclass(frozen=True)
class Roi:
    """The model's outputs at follow-up share h."""

    h: float
    c0: float
    c1: float
    p0: float
    p1: float
    r_base: float  # P / P0
    r_gpu: float
    n_base: int
    n_cxl: int

    @property
    def speedup(self) -> float:
        return self.r_gpu / self.r_base

    @property
    def gpu_saving(self) -> float:
        """1 - N_cxl / N_base (with the ceilings)."""
        return 1 - self.n_cxl / self.n_base


def roi(x: RoiInputs, h: float) -> Roi:
    """Appendix Table 1 at follow-up share h in [0, 1]."""
    require(0 <= h <= 1, f"--h {h}: the follow-up share must be in [0, 1]")
    c0 = x.prefill_flops
    c1 = x.new_ratio * c0
    p0 = c0 / x.slo_s
    p1 = c1 / (x.slo_s - x.load_s)
    r_base = x.gpu_flops / p0
    r_gpu = x.gpu_flops / (p0 * (1 - h) + p1 * h)
    return Roi(h, c0, c1, p0, p1, r_base, r_gpu, math.ceil(x.demand_rps / r_base),
               math.ceil(x.demand_rps / r_gpu))


def prefill_flops(params: float, tokens: float) -> float:
    """C0 = 2 M L (Table 1)."""
    return 2.0 * params * tokens


def records(x: RoiInputs, rows: list[Roi], source: str,
            method: dict[str, Any] | None = None) -> list:
    """One projected record per output and h (`source`: whose inputs, e.g. 'paper';
    `method`: added to each record's, e.g. the measurements the inputs came from)."""
    from dataclasses import asdict

    from kvbench.schema import Record

    out = []
    inputs = asdict(x)
    for r in rows:
        p = {"h": r.h, "inputs": source, **inputs}
        for metric, unit, value in (("roi_rps_per_gpu_base", "requests/s", r.r_base),
                                    ("roi_rps_per_gpu_cxl", "requests/s", r.r_gpu),
                                    ("roi_speedup", "x", r.speedup),
                                    ("roi_gpus_base", "GPUs", r.n_base),
                                    ("roi_gpus_cxl", "GPUs", r.n_cxl),
                                    ("roi_gpu_saving", "ratio", r.gpu_saving)):
            out.append(Record("run", "prefix-roi", metric, unit, "none", float(value), p,
                              [float(value)], provenance="projected",
                              method={"model": "CXL KV-storage paper appendix A.1 Table 1",
                                      "notes": list(PAPER_NOTES), **(method or {})}))
    return out


def derived(recs: list[dict[str, Any]], h: list[float], context: int, tier: str,
            slo_factor: float, match: dict[str, Any] | None = None) -> list:
    """The model's records at each h with the paper's inputs ("paper") and with inputs read
    from `kvbench serve-sim` records of one `context`-token request at batch 1 (those also
    matching `match`'s parameters), "measured": C0 = 2 M L of the records' model at L =
    context, P = C0 / the measured recompute TTFT (the FLOP/s this machine sustains on
    such a prefill), r = the records' new share, T_slo = slo_factor x the recompute TTFT
    (the scaled SLO of the Fig. 1c analog), T_load = the measured copy from `tier`.
    Every record is projected; the measured ones name the records they rest on."""
    from kvbench.models import get_spec

    want = {"context": context, "batch": 1, **(match or {})}

    def one(metric: str, path: str) -> dict[str, Any]:
        got = [r for r in recs if r.get("name") == "serve-sim" and r["metric"] == metric
               and r["status"] == "ok" and r["params"].get("path") == path
               and all(r["params"].get(k) == v for k, v in want.items())]
        require(len(got) == 1, f"ROI inputs: {len(got)} serve-sim {metric} records of "
                f"path {path} at {want}, need one")
        return got[0]

    rc, load = one("serve_ttft", "recompute"), one("serve_ttft_copy", tier)
    c0 = prefill_flops(get_spec(rc["params"]["model"]).params(), context)
    ours = RoiInputs(gpu_flops=c0 / rc["value"], prefill_flops=c0,
                     new_ratio=rc["params"]["new_ratio"], slo_s=slo_factor * rc["value"],
                     load_s=load["value"])
    source = {"inputs_from": [{k: r.get(k) for k in ("name", "metric", "value", "params",
                                                      "git_commit")} for r in (rc, load)],
              "rule": f"P = C0 / recompute TTFT, C0 = 2 M L, T_slo = {slo_factor:g} x "
                      f"recompute TTFT, T_load = {tier} copy"}
    paper = RoiInputs()
    return (records(paper, [roi(paper, v) for v in h], "paper")
            + records(ours, [roi(ours, v) for v in h], "measured", source))


def show(x: RoiInputs, rows: list[Roi], source: str) -> None:
    """The table of the model per h, then what the paper leaves unsaid."""
    from rich.table import Table

    from kvbench.console import console

    t = Table(title=f"ROI model (CXL KV-storage paper appendix A.1), {source} inputs: P "
              f"{x.gpu_flops / 1e12:.4g} TFLOP/s, C0 {x.prefill_flops / 1e12:.4g} TFLOP, r "
              f"{x.new_ratio:g}, T_slo {x.slo_s:g} s, T_load {x.load_s:g} s, R "
              f"{x.demand_rps:g} req/s [projected]")
    for col in ("h", "P0 TFLOP/s", "P1 TFLOP/s", "req/s/GPU base", "req/s/GPU cxl",
                "speedup", "GPUs base", "GPUs cxl", "fewer GPUs"):
        t.add_column(col)
    for r in rows:
        t.add_row(f"{r.h:g}", f"{r.p0 / 1e12:.4g}", f"{r.p1 / 1e12:.4g}", f"{r.r_base:.4g}",
                  f"{r.r_gpu:.4g}", f"{r.speedup:.3g}x", str(r.n_base), str(r.n_cxl),
                  f"{r.gpu_saving:.1%} (1 - 1/speedup: {1 - 1 / r.speedup:.1%})")
    console.print(t)
    for note in PAPER_NOTES:
        console.print(f"[dim]note:[/] {note}")
