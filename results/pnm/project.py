"""Issue 15, experiments 3-5: the CXL-PNM paper's Figs. 10-14, PROJECTED (not measured).

Usage: PYTHONPATH=. .venv/bin/python results/pnm/project.py   (then results/pnm/render.py)
Reads project-src.jsonl (suites/pnm-project.toml: arkvale, pnm-kv and png-kv at five
steady ratios on the bundled SmolLM2-135M, 4096-token prompts, its real selections) and
re-times every configuration below with `kvbench project`'s library: the a100-pnm profile
replicated to the configuration's GPU and PNM counts (kvbench.hwmodel.profile.replicate:
ideal tensor parallel GPUs, ideal data-parallel PNMs), the source run scaled to the
paper's model, context and the largest batch the configuration fits (kvbench.plan
.max_batch, T_Budget = context / 16), bookkeeping without a work model dropped (the paper's
selection runs in hardware). Writes projected.jsonl: decode tokens/s, energy per token,
tokens per $ (kvbench.hwmodel.project.records) and, for Fig. 13's configurations, busy
seconds per step by resource and op, each tagged with `experiment`; every record has
provenance "projected".

The baseline is arkvale (the GPU-CXL-memory ArkVale of section 4) on the GPUs alone (PNM
count 0, its recalls over the GPUs' PCIe 4.0 links); png-kv's steady ratio is #GPU /
(#GPU + #PNM), the source run at the nearest ratio measured (the rack's 16 GPUs + 48
PNMs, 1/4, takes the 1/5 run's selections; its own run was cut for time).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from kvbench.hwmodel.profile import load, replicate
from kvbench.hwmodel.project import project_run, records, runs
from kvbench.hwmodel.scale import Shape
from kvbench.models import get_spec
from kvbench.plan import PlanConfig, max_batch
from kvbench.schema import measured
from kvbench.store import load as load_results

HERE = Path(__file__).parent
K = 1024
RATIO = 1 / 16  # T_Budget / context (unstated in the paper; 8192 at 128K)
GEN = 4  # projected decode steps (the source runs' four)
SKIP = 1  # left out of the metrics: png-kv's pool starts empty after our prefill and fills
#           at step 1 (the paper's GPU keeps its steady set from the prefill it computes)
# (experiment, model, #GPU, context, #PNM counts): Fig. 10/11's server groups (the paper
# starts each group at #PNM = #GPU; its exact PNM counts are unstated), Fig. 12's rack
# (2 GPU nodes of 8, 1-4 PNM nodes of 16), Fig. 14's GPU scaling at 128K.
SERVER = [("fig10a", "llama-3.1-8b", g, c * K, tuple(g * k for k in (1, 2, 4, 8)))
          for g, c in ((1, 128), (2, 256), (4, 512), (8, 1024))] + \
         [("fig10b", "llama-3.1-70b", g, c * K, tuple(g * k for k in (1, 2, 4)))
          for g, c in ((2, 128), (4, 256), (8, 512))]
RACK = [("fig12", "llama-3.1-405b", 16, 1024 * K, (16, 32, 48, 64))]
GPU_SCALING = [("fig14", "llama-3.1-8b", g, 128 * K, ()) for g in (1, 2, 4, 8)]
METRICS = ("decode_tokens_per_s", "energy_per_token", "tokens_per_usd")


def sources() -> dict[tuple[str, float], list[dict]]:
    """(strategy, steady ratio or 0) -> the source run's trace records."""
    recs = load_results(HERE / "project-src.jsonl").records
    out = {}
    for group in runs(recs, "project-src.jsonl").values():
        p = group[0]["params"]
        out[(group[0]["name"], float(p.get("steady_ratio", 0.0)))] = group
    return out


def source(src: dict, name: str, ratio: float) -> list[dict]:
    key = min((k for k in src if k[0] == name), key=lambda k: abs(k[1] - ratio))
    return src[key]


def configs() -> list[tuple[str, str, int, int, int, str]]:
    """(experiment, model, #GPU, context, #PNM, strategy) of every projection; "half-batch"
    repeats Fig. 14's headline configurations at half the batch (sensitivity)."""
    out = []
    for exp, model, g, ctx, pnms in SERVER + RACK + GPU_SCALING:
        out.append((exp, model, g, ctx, 0, "arkvale"))
        out += [(exp, model, g, ctx, n, s) for n in pnms for s in ("pnm-kv", "png-kv")]
    return out + [("half-batch", "llama-3.1-8b", g, 128 * K, n, s)
                  for g, n, s in ((1, 0, "arkvale"), (8, 0, "arkvale"), (1, 8, "png-kv"))]


def project() -> None:
    src = sources()
    base = load("a100-pnm")
    with (HERE / "projected.jsonl").open("w") as f:
        for exp, model, g, ctx, n, name in configs():
            spec = get_spec(model)
            mb = max_batch(spec, ctx, PlanConfig(model=model, gpus=g, pnms=n,
                                                 budget_ratio=RATIO))
            batch = mb["baseline" if name == "arkvale" else name]
            batch = batch // 2 if exp == "half-batch" else batch
            tag = {"experiment": exp, "gpus": g, "pnms": n, "t_budget": mb["t_budget"],
                   "t_steady": mb["t_steady"] if name == "png-kv" else 0, "fits": batch}
            if batch < 1:
                f.write(json.dumps({"kind": "run", "name": name, "status": "waived",
                                    "provenance": "projected", "metric": "decode_tokens_per_s",
                                    "params": {"model": model, "prompt_len": ctx, **tag},
                                    "reason": "no sequence fits"}) + "\n")
                continue
            ratio = g / (g + n) if name == "png-kv" else 0.0
            recs = source(src, name, ratio)
            prof = replicate(base, g, n)
            tgt = Shape(spec, batch, ctx, GEN, 2)
            for r in records(recs, prof, "pinned", tgt, carried=False, skip=SKIP):
                if r.metric in METRICS:
                    d = r.to_dict()
                    d["params"].update(tag)
                    f.write(json.dumps(d) + "\n")
            if (exp, g) not in (("fig10a", 1), ("fig12", 16)):  # Fig. 13's configurations
                continue
            _, dec = project_run(recs, prof, "pinned", tgt, carried=False, skip=SKIP)
            for op in sorted({k for s in dec for k in s.ops}):
                r = measured("run", name, "busy_seconds_per_step", "s", "none",
                             [s.ops.get(op, 0.0) for s in dec],
                             {"model": model, "prompt_len": ctx, "batch": batch,
                              "where": op, "hardware": prof.name, **tag},
                             {"model": "kvbench.hwmodel.schedule", "source_run":
                              recs[0].get("command", "")})
                r.provenance = "projected"
                f.write(json.dumps(r.to_dict()) + "\n")


def load_projected() -> list[dict]:
    path = HERE / "projected.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _index(recs: list[dict]) -> dict[tuple, dict[str, float]]:
    """(experiment, model, #GPU, context, #PNM, strategy) -> metric values (+ batch)."""
    out: dict[tuple, dict[str, float]] = {}
    for r in recs:
        p = r["params"]
        key = (p["experiment"], p["model"], p["gpus"], p["prompt_len"], p["pnms"], r["name"])
        row = out.setdefault(key, {"batch": p["fits"], "t_steady": p["t_steady"],
                                   "t_budget": p["t_budget"]})
        if r.get("status", "ok") == "ok" and r["metric"] in METRICS:
            row[r["metric"]] = r["value"]
        elif r["metric"] == "busy_seconds_per_step":
            row[p["where"]] = statistics.fmean(r["samples"])
    return out


def _mean(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.2f}x" if xs else "-"


def _ratio(idx: dict, a: tuple, b: tuple, metric: str) -> float | None:
    x, y = idx.get(a, {}).get(metric), idx.get(b, {}).get(metric)
    return x / y if x and y else None


def tables() -> list[str]:
    """Markdown for table.md: Figs. 10-14 projected, the paper's values beside ours."""
    idx = _index(load_projected())
    if not idx:
        return ["(no projections yet: run suites/pnm-project.toml, then "
                "`python results/pnm/project.py`)"]
    out = ["Every number in this section is PROJECTED (kvbench.hwmodel, a100-pnm profile: "
           "A100-80GB at 2 TB/s and 312 TFLOPS FP16, PNM at 1.1 TB/s and 8 TFLOPS, Table 2 / "
           "Table 3 powers and prices; `kvbench hardware show a100-pnm`), from source runs "
           "of SmolLM2-135M (real weights, 4096 tokens) measured on a loaded 2-core CPU VM "
           "whose selections are carried over to Llama-3.1 shapes. The paper's numbers come "
           "from its cycle-level simulator of the same devices (Llama-3.1, InfiniBench "
           "En.Sum); its figures print no per-bar values, only the ratios quoted below. "
           f"Not stated by the paper, chosen here: T_Budget = context / {int(1 / RATIO)}, "
           "pages of 16 tokens (source), FP16 KV, batch = the largest that fits "
           "(`kvbench plan`), PNM counts per group, ideal TP/DP scaling, energy = idle power "
           "over the step plus (peak - idle) over busy time per device (host included), "
           "selection work in hardware (bookkeeping not carried over), decode steps 2-4 (step 1 "
           "fills png-kv's empty pool, an artefact of our prefill); png-kv's steady ratio "
           "#GPU / (#GPU + #PNM) from the source run at the nearest ratio (16 GPUs + 48 "
           "PNMs: the 1/5 run for 1/4).", "",
           "| model | #GPU | context | #PNM | batch base / pnm / png | tokens/s base | "
           "pnm-kv | png-kv | J/token base | pnm-kv | png-kv |", "|---|---|---|---|---|---|"
           "---|---|---|---|---|"]
    groups = sorted({k[:4] for k in idx if k[0].startswith("fig1") and k[0] != "fig14"},
                    key=lambda k: (k[0], k[2]))
    thr, pvb, ener, bve, low = [], [], [], [], []
    for exp, model, g, ctx in groups:
        base = (exp, model, g, ctx, 0, "arkvale")
        for n in sorted({k[4] for k in idx if k[:4] == (exp, model, g, ctx) and k[4]}):
            pk, pg = (exp, model, g, ctx, n, "pnm-kv"), (exp, model, g, ctx, n, "png-kv")
            cell = [idx.get(k, {}) for k in (base, pk, pg)]
            tps = [f"{c.get('decode_tokens_per_s', 0):,.0f}" if c.get("decode_tokens_per_s")
                   else "no fit" for c in cell]
            jpt = [f"{c['energy_per_token']:.3g}" if c.get("energy_per_token") else "-"
                   for c in cell]
            out.append(f"| {model} | {g} | {ctx // K}K | {n} | "
                       f"{' / '.join(str(c.get('batch', 0)) for c in cell)} | "
                       f"{' | '.join(tps)} | {' | '.join(jpt)} |")
            if exp == "fig12":
                continue
            for lst, a, b, m in ((thr, pg, pk, "decode_tokens_per_s"),
                                 (pvb, pg, base, "decode_tokens_per_s"),
                                 (ener, pg, pk, "energy_per_token"),
                                 (bve, base, pg, "energy_per_token")):
                v = _ratio(idx, a, b, m)
                if v:
                    lst.append(v)
            v = _ratio(idx, pk, base, "decode_tokens_per_s")
            if n == g and v is not None and v < 1:
                low.append(f"{model.split('-')[-1]} {g} GPU")
    out += ["", *_claims(idx, thr, pvb, ener, bve, low), "",
            "Why ours differ (projected, read off Fig. 13's rows below): the source runs "
            "attend their first two layers densely on the device (ArkVale's default; the "
            "paper does not say), 37% of the device's bytes per step (12.6 of 34.1 MB at "
            "4K), so PNM time hardly falls when png-kv moves steady pages to the GPU; the "
            "device still scores every page (min/max digests of 16-token pages: 1/8 of the "
            "keys) and the steady recall over PCIe (25 GB/s per GPU) precedes the device's "
            "attention in our graph. GPU scaling is ideal (no all-reduce), so our 8-GPU "
            "baseline keeps its tokens per $ where the paper's falls to 0.4x; energy counts "
            "idle power of every device and the host, which the paper may not.", "",
            *_fig13(idx), "", *_fig14(idx)]
    return out


def _claims(idx: dict, thr: list, pvb: list, ener: list, bve: list, low: list) -> list[str]:
    r = ("fig12", "llama-3.1-405b", 16, 1024 * K)

    def rack(m: str, a: str, b: str) -> list[float]:
        vals = [_ratio(idx, (*r, n, a), (*r, n if b != "arkvale" else 0, b), m)
                for n in RACK[0][4]]
        return [v for v in vals if v]

    e70 = _ratio(idx, ("fig10b", "llama-3.1-70b", 2, 128 * K, 0, "arkvale"),
                 ("fig10b", "llama-3.1-70b", 2, 128 * K, 8, "png-kv"), "energy_per_token")
    return ["| claim | paper | ours (projected) |", "|---|---|---|",
            f"| Fig. 10: png-kv / pnm-kv throughput, mean over server configs | 1.283x "
            f"(+28.3%) | {_mean(thr)} |",
            f"| Fig. 10: png-kv / baseline throughput, mean | 2.7x | {_mean(pvb)} |",
            f"| Fig. 10: pnm-kv below the baseline at #PNM = #GPU | happens | "
            f"{', '.join(low) or 'never'} |",
            f"| Fig. 11: png-kv / pnm-kv energy per token, mean | about 2.2x | {_mean(ener)} |",
            f"| Fig. 11: baseline / png-kv energy per token, mean | 4.9x | {_mean(bve)} |",
            f"| Fig. 11: 70B, 2 GPU + 8 PNM: baseline / png-kv energy | up to 60x | "
            f"{f'{e70:.1f}x' if e70 else 'baseline does not fit'} |",
            f"| Fig. 12: 405B 1M, png-kv / pnm-kv throughput | 1.085x | "
            f"{_mean(rack('decode_tokens_per_s', 'png-kv', 'pnm-kv'))} |",
            f"| Fig. 12: png-kv / pnm-kv energy | 1.193x | "
            f"{_mean(rack('energy_per_token', 'png-kv', 'pnm-kv'))} |",
            f"| Fig. 12: png-kv / baseline throughput | 2.6x | "
            f"{_mean(rack('decode_tokens_per_s', 'png-kv', 'arkvale'))} |",
            f"| Fig. 12: baseline / png-kv energy | 11.8x | "
            f"{_mean([1 / v for v in rack('energy_per_token', 'png-kv', 'arkvale')])} |"]


def _fig13(idx: dict) -> list[str]:
    out = ["Fig. 13 (projected): per-step latency and busy time per part, ms per decode step "
           "(busy times overlap; the paper: hidden-state transfer and Top-K negligible, the "
           "baseline dominated by attention and recall, PnG-KV below PNM-KV).", "",
           "| model | #GPU | #PNM | strategy | batch | step | GPU FC | GPU attention + scoring | "
           "PCIe copies | PNM (scoring + attention) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for exp, model, g, ctx in (("fig10a", "llama-3.1-8b", 1, 128 * K),
                               ("fig12", "llama-3.1-405b", 16, 1024 * K)):
        for key in sorted((k for k in idx if k[:4] == (exp, model, g, ctx)),
                          key=lambda k: (k[4], k[5])):
            c = idx[key]
            if not c.get("decode_tokens_per_s"):
                continue
            ms = {part: 1e3 * sum(v for w, v in c.items() if isinstance(w, str) and ":" in w
                                  and pred(w)) for part, pred in (
                ("fc", lambda w: w.split(":")[1] in ("pre", "post", "head")),
                ("attn", lambda w: w == "accel:attention" or w == "accel:compute"),
                ("copy", lambda w: w.startswith(("h2d", "d2h"))),
                ("pnm", lambda w: w.startswith("pnm")))}
            step = 1e3 * c["batch"] / c["decode_tokens_per_s"]
            out.append(f"| {model} {ctx // K}K | {g} | {key[4]} | {key[5]} | {c['batch']} | "
                       f"{step:.1f} | {ms['fc']:.1f} | {ms['attn']:.1f} | {ms['copy']:.1f} | "
                       f"{ms['pnm']:.1f} |")
    return out


def _fig14(idx: dict) -> list[str]:
    one = idx.get(("fig14", "llama-3.1-8b", 1, 128 * K, 0, "arkvale"), {}).get("tokens_per_usd")
    if not one:
        return []
    out = ["Fig. 14 (projected): tokens per $ (Table 3 $/h) relative to one GPU, Llama3.1-8B "
           "at 128K.", "", "| configuration | tokens/$ vs 1 GPU | paper |", "|---|---|---|"]
    for g in (1, 2, 4, 8):
        v = idx.get(("fig14", "llama-3.1-8b", g, 128 * K, 0, "arkvale"), {}).get("tokens_per_usd")
        out.append(f"| {g} GPU baseline | {v / one:.2f}x | {'0.4x' if g == 8 else '-'} |"
                   if v else f"| {g} GPU baseline | no fit | - |")
    for n in (1, 2, 4, 8):
        for s in ("pnm-kv", "png-kv"):
            v = idx.get(("fig10a", "llama-3.1-8b", 1, 128 * K, n, s), {}).get("tokens_per_usd")
            if v:
                out.append(f"| 1 GPU + {n} PNM {s} | {v / one:.2f}x | - |")
    v8 = idx.get(("fig14", "llama-3.1-8b", 8, 128 * K, 0, "arkvale"), {}).get("tokens_per_usd")
    p8 = idx.get(("fig10a", "llama-3.1-8b", 1, 128 * K, 8, "png-kv"), {}).get("tokens_per_usd")
    if v8 and p8:
        out.append(f"| 1 GPU + 8 PNM png-kv / 8 GPU baseline | {p8 / v8:.2f}x | 7.3x |")
    return [*out, "", *_sensitivity(idx)]


def _sensitivity(idx: dict) -> list[str]:
    """Fig. 14's headline and Fig. 11's 8B-at-128K energy ratio under unstated choices."""
    def get(exp: str, g: int, n: int, s: str, m: str) -> float | None:
        return idx.get((exp, "llama-3.1-8b", g, 128 * K, n, s), {}).get(m)

    def rows(label: str, exp14: str, exp8: str) -> str:
        p8 = get(exp8, 1, 8, "png-kv", "tokens_per_usd")
        b8 = get(exp14, 8, 0, "arkvale", "tokens_per_usd")
        e1, e8 = (get(exp14, 1, 0, "arkvale", "energy_per_token"),
                  get(exp8, 1, 8, "png-kv", "energy_per_token"))
        head = f"{p8 / b8:.2f}x" if p8 and b8 else "-"
        energy = f"{e1 / e8:.2f}x" if e1 and e8 else "-"
        return f"| {label} | {head} | {energy} |"

    # energy as max power x step time (Table 3's powers, every device busy all step)
    def maxpower(g: int, n: int, s: str, exp: str) -> float | None:
        c = idx.get((exp, "llama-3.1-8b", g, 128 * K, n, s), {})
        t = c.get("decode_tokens_per_s")
        return (400 * g + 150 * n) / t if t else None

    a, b = maxpower(1, 0, "arkvale", "fig14"), maxpower(1, 8, "png-kv", "fig10a")
    return ["Sensitivity of the headline ratios to choices the paper leaves open (projected; "
            "Llama3.1-8B, 128K):", "",
            "| choice | 1 GPU + 8 PNM png-kv / 8 GPU tokens per $ (paper 7.3x) | 1 GPU "
            "baseline / 1 GPU + 8 PNM png-kv energy per token |", "|---|---|---|",
            rows("batch: the largest that fits (default)", "fig14", "fig10a"),
            rows("batch: half the largest", "half-batch", "half-batch"),
            f"| energy: max power x step time (GPU 400 W, PNM 150 W, no host) | - | "
            f"{f'{a / b:.2f}x' if a and b else '-'} |",
            "", "T_Budget (1/16 of the context here) sets the baseline's batch and every "
            "strategy's attended share; the source runs fix it, so a second T_Budget needs "
            "second source runs (not done: time on the shared machine)."]


if __name__ == "__main__":
    project()
