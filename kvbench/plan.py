"""`kvbench plan`: capacity and cost of GPU and CXL-PNM configurations (CXL-PNM paper).

Arithmetic, not measurement: every figure is projected from a model spec (kvbench.models)
and the device capacities, powers and prices below.

- Memory demand per GPU vs context (Fig. 1a): weights / #GPU (tensor parallel) plus the
  KV of `--batch` sequences / #GPU, KV per token 2 L Hkv D e with e = 2 (FP16, which the
  paper does not state).
- Largest batch per configuration and context (Fig. 3b, section 4.2): "gpu" keeps every
  token on the GPUs; "baseline" (ArkVale with CXL memory, Alg. 1 line 4: T_Budget x B <=
  |P|) keeps T_Budget tokens per sequence on the GPUs and the rest in CXL memory;
  "pnm-kv" keeps no KV on the GPUs and whole sequences on each PNM (DP, section 3.2:
  #PNM x floor(PNM memory / sequence KV)); "png-kv" is pnm-kv's batch capped by T_Steady x
  B <= |P| (Alg. 1 line 7), T_Steady = ratio x T_Budget, ratio #GPU / (#GPU + #PNM).
  GPU memory left for KV is the memory less the weight shard; activations are ignored.
- Cost per device-hour (Table 3): operating = max power x electricity price ($0.181/kWh,
  March 2025 CPI), hardware = price / (amortisation years x 8760 h). The paper gives only
  the $/h; a 3-year amortisation of $20,000 per A100 and $7,000 per CXL-PNM reproduces its
  0.761 and 0.266 $/h to the last digit (our inference, recorded in the output).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import require
from kvbench.models import ModelSpec, get_spec
from kvbench.options import check_ranges, opt
from kvbench.schema import Record, measured
from kvbench.units import parse_size, parse_sizes

HOURS_PER_YEAR = 8760
# device -> (max power W, price $): Table 3 (power) and our price inference (module doc)
DEVICES: dict[str, tuple[float, float]] = {
    "a100-80gb": (400.0, 20_000.0),
    "cxl-pnm": (150.0, 7_000.0),
}
CONFIGS = ("gpu", "baseline", "pnm-kv", "png-kv")


@dataclass(frozen=True)
class PlanConfig:
    """Model, contexts, device counts and the cost model's inputs."""

    model: str = opt("llama-3.1-8b", "Model spec name (see `kvbench list`).")
    contexts: str = opt("32K,64K,128K,256K,512K,1M", "Context lengths in tokens (binary "
                        "suffixes: 128K = 131072).")
    gpus: int = opt(1, "GPUs (A100-80GB), tensor parallel.", min=1)
    pnms: int = opt(1, "CXL-PNM devices (512 GB each), data parallel.", min=0)
    batch: int = opt(1, "Sequences in the per-GPU demand table.", min=1)
    budget_tokens: int = opt(4096, "T_Budget per sequence (unstated in the paper; ArkVale's).",
                             min=1)
    budget_ratio: float = opt(0.0, "T_Budget as a share of the context when > 0 (section "
                              "2.3: T_Budget grows with the context); overrides "
                              "--budget-tokens.")
    gpu_memory: str = opt("80G", "Memory per GPU (A100-80GB: 80 GiB).")
    pnm_memory: str = opt("512G", "Memory per CXL-PNM (Table 2: 512 GB, read as GiB).")
    steady_ratio: float = opt(0.0, "T_Steady / T_Budget (0: #GPU / (#GPU + #PNM)).")
    electricity: float = opt(0.181, "Electricity price, $/kWh (Table 3).")
    years: float = opt(3.0, "Hardware amortisation in years (inferred; see the module).")
    json: bool = opt(False, "Print JSON instead of tables (--out FILE also writes it).")

    def __post_init__(self) -> None:
        check_ranges(self)
        require(0 <= self.steady_ratio <= 1, f"--steady-ratio {self.steady_ratio}: must be "
                "in [0, 1]")
        require(0 <= self.budget_ratio <= 1, f"--budget-ratio {self.budget_ratio}: must be "
                "in [0, 1]")
        require(self.electricity >= 0 and self.years > 0, "--electricity must be >= 0 and "
                "--years > 0")


def kv_per_token(spec: ModelSpec, elem: int = 2) -> int:
    return spec.kv_bytes_per_token(elem)


def gpu_demand(spec: ModelSpec, ctx: int, gpus: int, batch: int, elem: int = 2
               ) -> dict[str, float]:
    """Per-GPU bytes of weights and of `batch` sequences' full KV at `ctx` tokens (Fig. 1a),
    and per PNM the KV of one whole sequence (DP) with its min/max digests (page of 32)."""
    w = spec.params() * elem / gpus
    seq = ctx * kv_per_token(spec, elem)
    kv = batch * seq / gpus
    return {"weights": w, "kv": kv, "total": w + kv, "pnm_per_sequence": seq * (1 + 1 / 32)}


def max_batch(spec: ModelSpec, ctx: int, cfg: PlanConfig, elem: int = 2) -> dict[str, int]:
    """Largest batch of each configuration at `ctx` tokens (module docstring)."""
    kv_t = kv_per_token(spec, elem)
    gpu_mem = parse_size(cfg.gpu_memory) * cfg.gpus
    pnm_mem = parse_size(cfg.pnm_memory)
    free = max(gpu_mem - spec.params() * elem, 0)
    budget = min(int(cfg.budget_ratio * ctx) or cfg.budget_tokens, ctx)
    ratio = cfg.steady_ratio or cfg.gpus / (cfg.gpus + cfg.pnms)
    steady = int(ratio * budget)
    pnm = cfg.pnms * (pnm_mem // (ctx * kv_t))
    return {"t_budget": budget, "t_steady": steady,
            "gpu": free // (ctx * kv_t), "baseline": free // (budget * kv_t),
            "pnm-kv": pnm,
            "png-kv": min(pnm, free // (steady * kv_t)) if steady else pnm}


def device_cost(device: str, electricity: float, years: float) -> dict[str, float]:
    """$/h of one device: operating (max power x price), hardware (amortised), total."""
    watts, price = DEVICES[device]
    op = watts / 1000 * electricity
    hw = price / (years * HOURS_PER_YEAR)
    return {"power_w": watts, "operating": op, "hardware": hw, "total": op + hw}


def plan(cfg: PlanConfig) -> dict[str, Any]:
    """Everything `kvbench plan` prints, as one dict (all projected)."""
    spec = get_spec(cfg.model)
    contexts = parse_sizes(cfg.contexts)
    gpu = device_cost("a100-80gb", cfg.electricity, cfg.years)
    pnm = device_cost("cxl-pnm", cfg.electricity, cfg.years)
    return {
        "provenance": "projected",
        "model": spec.name, "gpus": cfg.gpus, "pnms": cfg.pnms,
        "assumptions": {"kv_dtype_bytes": 2, "gpu_memory": cfg.gpu_memory,
                        "pnm_memory": cfg.pnm_memory, "budget_tokens": cfg.budget_tokens,
                        "budget_ratio": cfg.budget_ratio,
                        "steady_ratio": cfg.steady_ratio or cfg.gpus / (cfg.gpus + cfg.pnms),
                        "prices": {d: v[1] for d, v in DEVICES.items()},
                        "amortisation_years": cfg.years, "electricity_per_kwh": cfg.electricity},
        "kv_bytes_per_token": kv_per_token(spec),
        "demand": [{"context": c, **gpu_demand(spec, c, cfg.gpus, cfg.batch)}
                   for c in contexts],
        "max_batch": [{"context": c, **max_batch(spec, c, cfg)} for c in contexts],
        "cost": {"a100-80gb": gpu, "cxl-pnm": pnm,
                 "config_per_hour": cfg.gpus * gpu["total"] + cfg.pnms * pnm["total"]},
    }


# parameters of plan records (kvbench.derive reads them for an experiment's tables)
RECORD_PARAMS = (*(f.name for f in dataclasses.fields(PlanConfig)), "context", "device",
                 "t_budget", "t_steady")


def derived(records: list[dict[str, Any]], configs: list[dict[str, Any]]) -> list[Record]:
    """An experiment's `[[derive]] function = "kvbench.plan:derived"`: the plan records of
    each of `configs` (PlanConfig fields; `records` unused: a plan is arithmetic)."""
    from kvbench.errors import KvbenchError

    out = []
    for i, c in enumerate(configs):
        try:
            cfg = PlanConfig(**c)
        except TypeError as e:
            raise KvbenchError(f"plan config {i + 1}: {e}") from None
        out += plan_records(cfg)
    return out


def plan_records(cfg: PlanConfig) -> list[Record]:
    """The plan as projected run records named "plan" (an experiment's `[[plan]]`): per
    context the largest batch of each configuration (`where`: gpu, baseline, pnm-kv,
    png-kv; T_Budget and T_Steady as parameters), per device its max power and $/h
    (`where`: operating, hardware, total), and the configuration's $/h. Parameters: the
    config's fields (but `json`)."""
    result = plan(cfg)
    base = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "json"}
    method = {"model": "kvbench.plan", "assumptions": result["assumptions"]}

    def rec(metric: str, unit: str, value: float, **params: Any) -> Record:
        r = measured("run", "plan", metric, unit, "none", [value], {**base, **params}, method)
        r.provenance = "projected"
        return r

    out = [rec("max_batch", "sequences", row[c], context=row["context"], where=c,
               t_budget=row["t_budget"], t_steady=row["t_steady"])
           for row in result["max_batch"] for c in CONFIGS]
    for device, cost in result["cost"].items():
        if device in DEVICES:
            out.append(rec("max_power", "W", cost["power_w"], device=device))
            out += [rec("cost_per_hour", "$/h", cost[part], device=device, where=part)
                    for part in ("operating", "hardware", "total")]
    return [*out, rec("cost_per_hour", "$/h", result["cost"]["config_per_hour"],
                      device="configuration", where="total")]


def render(result: dict[str, Any]) -> None:
    """Print the plan's three tables (labelled projected)."""
    from rich.table import Table

    from kvbench.console import console
    from kvbench.units import format_bytes, format_size

    g, p = result["gpus"], result["pnms"]
    t = Table(title=f"projected: per-GPU memory demand, {result['model']}, {g} GPU(s) "
                    "(Fig. 1a; FP16 KV, full KV on the GPUs)")
    for col in ("context", "weights/GPU", "KV/GPU", "total/GPU", "KV+digests/sequence (PNM)"):
        t.add_column(col)
    for r in result["demand"]:
        t.add_row(format_size(r["context"]), format_bytes(r["weights"]), format_bytes(r["kv"]),
                  format_bytes(r["total"]), format_bytes(r["pnm_per_sequence"]))
    console.print(t)
    t = Table(title=f"projected: largest batch, {g} GPU(s) + {p} PNM(s)")
    for col in ("context", "T_Budget", "T_Steady", *CONFIGS):
        t.add_column(col)
    for r in result["max_batch"]:
        t.add_row(format_size(r["context"]), str(r["t_budget"]), str(r["t_steady"]),
                  *(str(r[c]) for c in CONFIGS))
    console.print(t)
    a = result["assumptions"]
    t = Table(title=f"projected: cost per device (Table 3; ${a['electricity_per_kwh']}/kWh, "
                    f"{a['amortisation_years']:g}-year amortisation)")
    for col in ("device", "max power", "operating $/h", "hardware $/h", "total $/h"):
        t.add_column(col)
    for name in DEVICES:
        c = result["cost"][name]
        t.add_row(name, f"{c['power_w']:.0f} W", f"{c['operating']:.3f}", f"{c['hardware']:.3f}",
                  f"{c['total']:.3f}")
    console.print(t)
    console.print(f"configuration: {g} GPU(s) + {p} PNM(s) = "
                  f"${result['cost']['config_per_hour']:.2f}/h (projected)")


def run(cfg: PlanConfig, out: Path | None) -> None:
    """`kvbench plan`: print the tables (or JSON), and write the JSON to `out` when given."""
    import json

    result = plan(cfg)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    if cfg.json:
        print(json.dumps(result, indent=1))
    else:
        render(result)
