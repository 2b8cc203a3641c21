"""Render issue 15's experiments (suites/pnm-*.toml, run.sh, project.py) into table.md.

Usage: PYTHONPATH=. .venv/bin/python results/pnm/render.py
Reads the raw outputs beside this file (RAW: recalls*, ppl*, parallel, passkey, shapes-*;
on the loaded machine some cases ran as single `kvbench run` commands with the suite's
parameters into files of their own, e.g. ppl-arkvale.jsonl; any may be missing), folds
them into summary.jsonl (committed: traces other than the decode-phase KEEP ones dropped,
the device counters summed over layers; records of files not here are kept) and writes
table.md: recalls per layer of arkvale vs png-kv's steady selection (Figs. 3a, 8a
analogs), perplexity and passkey at equal budgets, dp vs tp counts (Fig. 7), the runs on
the papers' model shapes (all measured), `kvbench plan`'s Table 3 and batch sizes, and
project.py's Figs. 10-14 (projected), each with the paper's values beside ours.
"""

from __future__ import annotations

import fnmatch
import json
import statistics
from collections import defaultdict
from pathlib import Path

from measured import parallel_table, passkey_table, ppl_table, shapes_table  # beside this
from project import tables as projection_tables  # results/pnm/project.py, beside this file

from kvbench.plan import PlanConfig, plan
from kvbench.store import open_text, read_lines

HERE = Path(__file__).parent


RAW = ("recalls*.jsonl", "ppl*.jsonl", "parallel.jsonl", "passkey.jsonl",
       "shapes-*.jsonl")  # raw outputs, kept local
SUMMED = ("trace.topk_sorts", "trace.reductions", "trace.device_load", "trace.bytes_moved")
KEEP = ("trace.pages", "trace.topk_sorts", "trace.reductions", "trace.device_load",
        "trace.bytes_moved")  # decode-phase traces summary.jsonl keeps


def summarise() -> None:
    """Rewrite summary.jsonl (committed) from the raw files when any is here: environment
    lines and every record but the traces outside KEEP, each tagged with its file; the
    summary's records of files not here (run elsewhere or earlier) are kept."""
    raw = sorted({p for pattern in RAW for p in HERE.glob(pattern)})
    if not raw:
        return
    out, names = HERE / "summary.jsonl.gz", {p.name for p in raw}
    old = [x for x in read_lines(out) if json.loads(x).get("file") not in names
           ] if out.exists() else []
    with open_text(out, "w") as f:
        f.writelines(x + "\n" for x in old)
        for path in raw:
            summed: dict[tuple, dict] = {}  # device counters summed over layers
            for line in path.read_text().splitlines():
                r = json.loads(line)
                m, phase = r.get("metric", ""), r.get("params", {}).get("phase")
                if m.startswith("trace.") and not (m in KEEP and phase == "decode"):
                    continue
                if m == "trace.bytes_moved" and r["params"]["where"] != "pnm_reduce":
                    continue
                if m in SUMMED:
                    p = {k: v for k, v in r["params"].items() if k != "layer"}
                    key = (r.get("command"), m, json.dumps(p, sort_keys=True))
                    if key in summed:
                        acc = summed[key]
                        acc["samples"] = [a + b for a, b in zip(acc["samples"], r["samples"],
                                                                strict=True)]
                    else:
                        summed[key] = {**r, "params": {**p, "layer": "all"}}
                    continue
                f.write(json.dumps({**r, "file": path.name}) + "\n")
            for r in summed.values():
                r.pop("stats", None)
                r["value"] = statistics.median(r["samples"])
                f.write(json.dumps({**r, "file": path.name}) + "\n")


def records(pattern: str) -> list[dict]:
    """The ok run records of summary.jsonl that came from files matching `pattern`."""
    path = HERE / "summary.jsonl.gz"
    out = []
    for line in read_lines(path) if path.exists() else []:
        r = json.loads(line)
        if (r.get("kind") == "run" and r.get("status") == "ok"
                and fnmatch.fnmatch(r["file"], pattern)):
            out.append(r)
    return out


def recall_rows(recs: list[dict], first: int = 0) -> dict[tuple, dict[int, float]]:
    """(strategy, context, #PNM, steady tokens) -> {layer: mean pages recalled per step},
    over decode steps first+1.. (first=1 leaves out png-kv's first fill of its pool)."""
    per: dict[tuple, dict[int, float]] = defaultdict(dict)
    for r in recs:
        p = r["params"]
        if (r["metric"] == "trace.pages" and p.get("where") == "recalled"
                and p.get("phase") == "decode"):
            key = (r["name"], p["prompt_len"], p.get("devices", "-"), p.get("steady_tokens", "-"))
            per[key][int(p["layer"])] = statistics.fmean(r["samples"][first:])
    return per


def recall_tables(recs: list[dict]) -> list[str]:
    per, later = recall_rows(recs), recall_rows(recs, first=1)
    if not per:
        return ["(no recall records yet: run `kvbench suite run suites/pnm-recalls.toml`)"]
    h2d = {(r["name"], r["params"]["prompt_len"], r["params"].get("devices", "-")): r["value"]
           for r in recs if r["metric"] == "bytes_moved_per_step"
           and r["params"].get("where") == "h2d"}
    out = ["Pages recalled per decode step (16 steps, batch 1, summed over the 3 KV heads): "
           "mean over the 28 sparse layers, the same without step 1 (png-kv's pool starts "
           "empty after the prefill and is filled at step 1; arkvale's prefill leaves its "
           "pool full), the busiest layer, all layers together, and the h2d bytes per step "
           "(median; png-kv's include the device's outputs and lse). T_Steady = 512 / (1 + "
           "#PNM) tokens: 256 (8 pages) at #PNM 1, 56 (1 page) at #PNM 8.", "",
           "| strategy | context | #PNM | T_Steady | per layer (mean) | same, steps 2-16 | "
           "busiest layer | all layers | h2d B/step |", "|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(per, key=lambda k: (k[0], k[1], str(k[2]))):
        layers = per[key]
        sparse = [v for layer, v in layers.items() if layer >= 2]
        top = max(layers, key=layers.__getitem__)
        b = h2d.get(key[:3])
        sparse2 = [v for layer, v in later[key].items() if layer >= 2]
        out.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | "
                   f"{statistics.fmean(sparse) if sparse else 0:.2f} | "
                   f"{statistics.fmean(sparse2) if sparse2 else 0:.2f} | {top} "
                   f"({layers[top]:.2f}) | {sum(layers.values()):.1f} | "
                   f"{'-' if b is None else f'{b:,.0f}'} |")
    biggest = [k for k in per if k[1] == max(x[1] for x in per)]
    if biggest:
        out += ["", f"Per layer at context {biggest[0][1]} (mean pages recalled per step):", "",
                "| layer | " + " | ".join(f"{k[0]} #PNM {k[2]}" for k in sorted(
                    biggest, key=str)) + " |", "|---|" + "---|" * len(biggest)]
        for layer in range(2, 30):
            out.append(f"| {layer} | " + " | ".join(
                f"{per[k].get(layer, 0):.2f}" for k in sorted(biggest, key=str)) + " |")
    out += ["", "The paper (Llama3.1-8B, 1 A100, 64K-320K tokens; figures without numbers in "
            "the text): Fig. 3a, ArkVale's average recalls per layer rise steadily with the "
            "context; Fig. 8a, under Steady Selection the recalls drop sharply as #PNM grows "
            "(1 GPU). ArkVale section 5.1 / CXL-PNM section 2.3: fewer than 10 recalls per "
            "step, about 5 MB. Ours: SmolLM2-135M at 512-2048 tokens on a loaded 2-core CPU "
            "VM (counts, not times)."]
    return out


def plan_tables() -> list[str]:
    r = plan(PlanConfig(model="llama-3.1-8b", contexts="128K", gpus=1, pnms=8))
    g, p = r["cost"]["a100-80gb"], r["cost"]["cxl-pnm"]
    r70 = plan(PlanConfig(model="llama-3.1-70b", contexts="128K", gpus=2, pnms=8))
    b70 = r70["max_batch"][0]
    return [
        "| quantity | A100 (ours) | A100 (paper) | CXL-PNM (ours) | CXL-PNM (paper) |",
        "|---|---|---|---|---|",
        f"| max power | {g['power_w']:.0f} W | ~400 W | {p['power_w']:.0f} W | ~150 W |",
        f"| operating $/h | {g['operating']:.3f} | 0.072 | {p['operating']:.3f} | 0.027 |",
        f"| hardware $/h | {g['hardware']:.3f} | 0.761 | {p['hardware']:.3f} | 0.266 |",
        "", "Projected by `kvbench plan` (Table 3): operating = power x $0.181/kWh; hardware = "
        "price / (3 years x 8760 h) with $20,000 per A100 and $7,000 per CXL-PNM, prices and "
        "amortisation our inference (the paper gives only the $/h). 1 GPU + 8 PNM: "
        f"${g['total'] + 8 * p['total']:.2f}/h; 8 GPUs: ${8 * g['total']:.2f}/h (projected).",
        "", f"Largest batch, Llama3.1-70B at 128K on 2 GPUs + 8 PNMs (projected, FP16 KV, "
        f"512 GiB per PNM, whole sequences per PNM): pnm-kv {b70['pnm-kv']} (paper, section "
        f"4.2: \"from 1 to 96\"); all KV on the 2 GPUs: {b70['gpu']} (paper's baseline: 1, "
        "with ArkVale's T_Budget, which it does not state).", "",
        *sensitivity()]


def sensitivity() -> list[str]:
    """How the unstated values move the capacity figures (projected)."""
    out = ["Sensitivity to values the paper does not state (projected by `kvbench plan`):", "",
           "| setting | value | largest batch |", "|---|---|---|"]
    for t in (1024, 4096, 16384):
        b = plan(PlanConfig(model="llama-3.1-8b", contexts="128K", gpus=1, pnms=8,
                            budget_tokens=t))["max_batch"][0]
        out.append(f"| Llama3.1-8B, 128K, 1 GPU: ArkVale baseline vs T_Budget | {t} | "
                   f"{b['baseline']} (pnm-kv with 8 PNMs: {b['pnm-kv']}) |")
    for mem, label in (("512G", "512 GiB"), ("512000000000", "512 GB (decimal)")):
        b = plan(PlanConfig(model="llama-3.1-405b", contexts="1M", gpus=16, pnms=16,
                            pnm_memory=mem))["max_batch"][0]
        out.append(f"| Llama3.1-405B, 1M (2^20) tokens, 16 PNMs: pnm-kv vs PNM memory | "
                   f"{label} | {b['pnm-kv']} |")
    out += ["", "A 1M-token 405B sequence (504 GiB of FP16 KV) fits a 512 GiB module but not a "
            "512 GB one, so whether strict request-level DP can hold it at all depends on a "
            "unit the paper leaves open (spec sheet section 5)."]
    return out


def main() -> None:
    summarise()
    lines = ["# CXL-PNM (issue 15): recalls, accuracy, DP vs TP, capacity, cost and the "
             "paper's Figs. 10-14", "",
             "Generated by `render.py` from the suites `suites/pnm-*.toml` and `run.sh` "
             "(measured on the bundled SmolLM2-135M, fp32, on a 2-core CPU VM shared with "
             "other jobs, niced, one or two threads), `kvbench plan` (projected arithmetic) "
             "and `project.py` (projected: `kvbench project`'s model on the a100-pnm "
             "profile). Measured and projected numbers are in separate sections, each "
             "labelled.", "",
             "## Recalls per layer: arkvale vs png-kv steady selection (Figs. 3a, 8a analogs; "
             "measured counts)", "", *recall_tables(records("recalls*.jsonl")), "",
             "## Perplexity at equal budget (measured)", "", *ppl_table(records("ppl*.jsonl")),
             "", "## Passkey retrieval (measured)", "", *passkey_table(records("passkey.jsonl")),
             "", "## DP vs TP over the device roles (Fig. 7; measured counts)", "",
             *parallel_table(records("parallel.jsonl")),
             "", "## On the papers' model shapes (measured)", "",
             *shapes_table(records("shapes-*.jsonl")),
             "", "## Table 3 and capacity (projected)", "", *plan_tables(), "",
             "## Throughput, energy, latency and cost: Figs. 10-14 (PROJECTED)", "",
             *projection_tables(), ""]
    (HERE / "table.md").write_text("\n".join(lines))
    print(f"wrote {HERE / 'table.md'}")


if __name__ == "__main__":
    main()
