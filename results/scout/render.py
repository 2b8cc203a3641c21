"""Render issue 13's experiments (suites/scout-*.toml) beside ScoutAttention's figures.

Usage: PYTHONPATH=. .venv/bin/python results/scout/render.py
Reads query.jsonl, ratio.jsonl, ppl.jsonl, passkey.jsonl and speed.jsonl beside this file
when present (raw suite outputs, kept local: per-layer traces of every quantity) and
intervals.json (the calibrated R_l); writes summary.jsonl (every record but the traces; the
decode traces of q_cosine, cpu_ratio and pages kept, of the accuracy suites only q_cosine,
pred_error and pred_overlap), table.md and
report/report.html (`kvbench report summary.jsonl --format html`). A suite whose raw file is
absent keeps its records from the previous summary.jsonl (the raw files are not committed).
The baselines of experiment 3 (full, quest, infinigen, hgca at the same budgets and
protocols) are read from ../page-sparse/summary.jsonl.gz.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvbench.store import load, read_lines, slim
from kvbench.strategies import STRATEGIES, variants

HERE = Path(__file__).parent
KEEP = ("trace.q_cosine", "trace.cpu_ratio", "trace.pages", "trace.pred_error",
        "trace.pred_overlap")
RAW = {"query.jsonl": "suites/scout-query.toml", "ratio.jsonl": "suites/scout-ratio.toml",
       "ppl.jsonl": "suites/scout-ppl.toml", "passkey.jsonl": "suites/scout-passkey.toml",
       "speed.jsonl": "suites/scout-speed.toml"}
ACCURACY = ("ppl.jsonl", "passkey.jsonl")
BASELINES = ("full", "quest", "infinigen", "hgca")  # experiment 3's, from page-sparse
# ScoutAttention Table 1 (cosine of predicted vs real query), 7-12B models on GPU
TABLE1 = {"Qwen3-8B": 0.94, "Gemma3-12B": 0.93, "Llama3.1-8B": 0.96, "Mistral-7B": 0.97,
          "GLM4-9B": 0.94}
DIFF = ("Ours: SmolLM2-135M (30 layers, 9 q / 3 KV heads, D 64), float32, the accelerator "
        "role on a 2-core CPU VM shared with other jobs. Paper: 7-14B models (Qwen3-8B for "
        "Fig. 6, Qwen3-14B for Figs. 8-12), an 80 GB HBM GPU, PCIe 4.0 x16, a 36-core CPU, "
        "contexts up to 64K tokens and a 2048-token budget.")


def pick(records: list[dict], metric: str, name: str | None = None,
         **params: object) -> list[dict]:
    return [r for r in records if r["metric"] == metric and r["status"] == "ok"
            and (name is None or r["name"] == name)
            and all(r["params"].get(k) == v for k, v in params.items())]


def query_table(records: list[dict]) -> list[str]:
    layers = {int(r["params"]["layer"]): statistics.fmean(r["samples"])
              for r in pick(records, "trace.q_cosine")
              if r["params"].get("prompt_len") == 256}
    if not layers:
        return ["(query.jsonl not run)"]
    vals = list(layers.values())
    rest = [v for k, v in layers.items() if k != min(layers)]
    out = ["| | cosine |", "|---|---|"]
    out += [f"| ours, mean over layers {min(layers)}-{max(layers)} | "
            f"{statistics.fmean(vals):.3f} |",
            f"| ours, median over layers | {statistics.median(vals):.3f} |",
            f"| ours, mean without layer {min(layers)} (predicted from the embeddings) | "
            f"{statistics.fmean(rest):.3f} |",
            f"| ours, min / max layer | {min(vals):.3f} (layer {min(layers, key=layers.get)}) "
            f"/ {max(vals):.3f} (layer {max(layers, key=layers.get)}) |"]
    out += [f"| paper, {m} | {v:.2f} |" for m, v in TABLE1.items()]
    out += ["", "Per layer (mean over 32 decode steps, 9 query heads):", "",
            "| layer | " + " | ".join(str(k) for k in sorted(layers)) + " |",
            "|---|" + "---|" * len(layers),
            "| cosine | " + " | ".join(f"{layers[k]:.2f}" for k in sorted(layers)) + " |"]
    return out


def _case(r: dict) -> str:
    p = r["params"]
    if p.get("calibrate_recall"):
        return "no recall (calibration run)"
    if p.get("recall_intervals"):
        return "recall, calibrated R_l"
    return f"recall, R = {p.get('recall_interval')} in every layer"


def ratio_table(records: list[dict]) -> list[str]:
    rows = pick(records, "cpu_compute_ratio_per_step", prompt_len=1024, mode="eval")
    if not rows:
        return ["(ratio.jsonl not run)"]
    out = ["| case | mean ratio | first 8 steps | last 8 steps | max | pages recalled/step "
           "(all layers) | recall bytes/step | mean R_l | ppl | top-10 recall |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, p = r["samples"], r["params"]
        rec = pick(records, "pages_recalled_per_step", "scout", **p)
        byt = pick(records, "bytes_moved_per_step", "scout", **{**p, "where": "h2d.recall"})
        ppl = pick(records, "perplexity", "scout", **p)
        top = pick(records, "top10_recall", "scout", **p)
        def first(x: list[dict], fmt: str, scale: float = 1.0) -> str:
            return format(statistics.fmean(x[0]["samples"]) * scale if x[0]["samples"]
                          else x[0]["value"], fmt) if x else "-"

        out.append(f"| {_case(r)} | {statistics.fmean(s):.1%} | {statistics.fmean(s[:8]):.1%}"
                   f" | {statistics.fmean(s[-8:]):.1%} | {max(s):.1%} | {first(rec, '.1f')} | "
                   f"{first(byt, '.1f', 1e-3)} kB | {p.get('interval_mean') or 0:.1f} | "
                   f"{ppl[0]['value'] if ppl else '-':.4} | "
                   f"{top[0]['value'] if top else '-':.3} |")
    out += ["| paper Fig. 6a, no recall (Qwen3-8B) | rises with steps | | | | | | | | |",
            "| paper Fig. 6b, recall, tau 12% (Qwen3-8B) | 8.2% | | | | | | 8.7 | | |"]
    f = HERE / "intervals.json"
    if f.exists():
        doc = json.loads(f.read_text())
        r = doc["intervals"]
        out += ["", f"Calibrated R_l (tau {doc['tau']:.0%}, {doc['steps']} steps without "
                f"recall; 0 = dense layer; layers never over tau within the run: "
                f"{doc['censored']}):", "", "| layer | " + " | ".join(map(str, range(len(r))))
                + " |", "|---|" + "---|" * len(r), "| R_l | " + " | ".join(map(str, r)) + " |",
                "| mean ratio, no recall | " + " | ".join(f"{x:.0%}" for x in doc["mean_ratio"])
                + " |"]
    return out


def _budget(r: dict) -> int | None:
    p = r["params"]
    return p.get("budget_tokens", p.get("gpu_tokens"))


def _label(r: dict) -> str:
    """The row's strategy with the variant that ran; a record of a strategy that has variants
    now but ran before they existed is named by its version."""
    name, variant = r["name"], r["params"].get("variant")
    if name == "scout":
        return "scout" if r["params"].get("precompute", True) else "scout, no precompute"
    if variant:
        return f"{name} ({variant})"
    if variants(STRATEGIES.get(name).params):
        return f"{name} (v{r['version']}, before variants)"
    return name


def _baselines(metric: str, **proto: object) -> list[dict]:
    """Full, quest, infinigen and hgca records of `metric` under `proto` from the
    page-sparse summary (quest's and infinigen's defaults; page-sparse's arkvale window
    variants are not baselines here)."""
    base = HERE.parent / "page-sparse" / "summary.jsonl.gz"
    if not base.exists():
        return []
    runs = [r for r in map(json.loads, read_lines(base)) if r.get("kind") == "run"]
    return [r for r in pick(runs, metric, **proto) if r["name"] in BASELINES]


def _same(pool: list[dict], metric: str, r: dict, **extra: object) -> list[dict]:
    """Records of `metric` from r's run (same strategy and params, plus `extra`)."""
    want = {**{k: v for k, v in r["params"].items() if k != "where"}, **extra}
    return [x for x in pool if x["metric"] == metric and x["name"] == r["name"]
            and x["status"] == "ok" and x["version"] == r["version"]
            and x["params"].get("variant") == r["params"].get("variant")
            and all(x["params"].get(k) == v for k, v in want.items())]


def _tokens(pool: list[dict], r: dict) -> float:
    return sum(x["value"] for x in _same(pool, "tokens_attended_per_step", r))


def ppl_table(records: list[dict]) -> list[str]:
    """Scout with and without the predicted query beside full, quest, infinigen and hgca at
    the same budgets and protocol (page-sparse-ppl)."""
    proto = {"mode": "eval", "prompt_len": 1, "gen_len": 511}
    others = _baselines("perplexity", **proto)
    full = [r for r in others if r["name"] == "full"]
    mine = pick(records, "perplexity", **proto)
    if not full or not mine:
        return ["(not run: suites/scout-ppl.toml)"]
    f = full[0]["value"]
    base = HERE.parent / "page-sparse" / "summary.jsonl.gz"
    pool = records + [r for r in map(json.loads, read_lines(base))
                      if r.get("kind") == "run"]
    budgets = sorted({_budget(r) for r in mine})
    out = [f"Full attention: {f:.3f} (results/page-sparse, same text and protocol)", "",
           "| budget | strategy | perplexity | vs full | tokens attended (accel + host) | "
           "host share | top-10 recall | predicted-query error (median / worst layer) | "
           "block overlap (median / worst) |", "|---|---|---|---|---|---|---|---|---|"]
    rank = []
    for b in budgets:
        rows = [r for r in others if _budget(r) == b] + [r for r in mine if _budget(r) == b]
        rows.sort(key=lambda r: r["value"])
        for r in rows:
            ratio = _same(pool, "cpu_compute_ratio_per_step", r)
            top = _same(pool, "top10_recall", r)
            cells = []
            for m in ("predicted_query_rel_error", "predicted_block_overlap"):
                x = _same(pool, m, r)
                cells.append(f"{x[0]['value']:.3f} / {x[0]['method']['worst']:.3f} (layer "
                             f"{x[0]['method']['worst_layer']})" if x else "-")
            share = f"{statistics.fmean(ratio[0]['samples']):.1%}" if ratio else "-"
            recall = f"{top[0]['value']:.2f}" if top else "-"
            out.append(f"| {b} | {_label(r)} | {r['value']:.3f} | {r['value'] / f - 1:+.1%} | "
                       f"{_tokens(pool, r):.0f} | {share} | {recall} | " + " | ".join(cells)
                       + " |")
        rank.append(f"- budget {b}: " + " < ".join(
            f"{_label(r)} {r['value']:.2f} ({_tokens(pool, r):.0f} tok)" for r in rows))
    out += ["", "Ranking by perplexity at each budget (tokens attended per decode step, layer "
            "and sequence in brackets):", "", *rank, "",
            "Paper Fig. 7 (LongBench accuracy, Qwen3-8B, budgets 1024 and 2048 of contexts up "
            "to 64K, GPU; not perplexity): scout within 2.5% of full at budget 1024 and 2.1% "
            "at 2048 (the abstract says 2.4%, the introduction under 2.1%, the conclusion "
            "2.1%), slightly below InfiniGen. Our budgets are 1/8 and 1/4 of a 512-token "
            "context (the paper's 2048 of 16K-64K is 1/8-1/32)."]
    return out


def pred_error_table(records: list[dict]) -> list[str]:
    """Per layer: the relative error of the layer's attention output that the predicted
    query adds (against the real query's own selection, attended whole) and the share of
    the real query's blocks it selected, mean over decode steps."""
    runs = pick(records, "predicted_query_rel_error")
    if not runs:
        return ["(no --pred-error run yet)"]
    out = []
    proto = {"mode": "eval", "prompt_len": 1, "gen_len": 511}
    ppl = {(_budget(r), _label(r)): r["value"] for r in pick(records, "perplexity", **proto)}
    for b in sorted({b for b, _ in ppl}):
        if (b, "scout") in ppl and (b, "scout, no precompute") in ppl:
            out.append(f"- End to end, budget {b}: perplexity {ppl[b, 'scout']:.3f} with the "
                       f"predicted query vs {ppl[b, 'scout, no precompute']:.3f} with the real "
                       f"one ({ppl[b, 'scout'] / ppl[b, 'scout, no precompute'] - 1:+.1%}).")
    out += [""] if out else []
    for r in runs:
        p = r["params"]
        extra = {k: p[k] for k in ("mode", "budget_tokens", "prompt_len") if k in p}
        row = {}
        for q in ("pred_error", "pred_overlap"):
            row[q] = {int(x["params"]["layer"]): statistics.fmean(x["samples"])
                      for x in pick(records, f"trace.{q}", "scout", **extra)
                      if x["params"].get("precompute", True) and x["samples"]}
        layers = sorted(row["pred_error"])
        cos = {int(x["params"]["layer"]): statistics.fmean(x["samples"])
               for x in pick(records, "trace.q_cosine", "scout", **extra) if x["samples"]}
        out += [f"{p['mode']}, prompt {p['prompt_len']}, budget {p['budget_tokens']} "
                f"(median over layers {r['value']:.3f}, mean {r['method']['mean']:.3f}):", "",
                "| layer | " + " | ".join(map(str, layers)) + " |",
                "|---|" + "---|" * len(layers),
                "| output error | " + " | ".join(f"{row['pred_error'][k]:.3f}"
                                                 for k in layers) + " |",
                "| block overlap | " + " | ".join(f"{row['pred_overlap'].get(k, 0):.2f}"
                                                  for k in layers) + " |",
                "| query cosine | " + " | ".join(f"{cos[k]:.2f}" if k in cos else "-"
                                                 for k in layers) + " |", ""]
    return out


def passkey_table(records: list[dict]) -> list[str]:
    """Scout's passkey accuracy beside full, quest, infinigen and hgca (page-sparse-passkey)
    at the same prompt, depth and budgets."""
    proto = {"mode": "passkey", "prompt_len": 2048, "depth": 0.5}
    mine = pick(records, "passkey_accuracy", **proto)
    if not mine:
        return ["(not run: suites/scout-passkey.toml)"]
    others = _baselines("passkey_accuracy", **proto)
    base = HERE.parent / "page-sparse" / "summary.jsonl.gz"
    pool = records + [r for r in map(json.loads, read_lines(base))
                      if r.get("kind") == "run"]
    budgets = sorted({_budget(r) for r in mine})
    full = [r for r in others if r["name"] == "full"]
    out = [("Full attention at 2048 tokens: " + f"{full[0]['value']:.2f}") if full else
           "Full attention at 2048 tokens: not in page-sparse-passkey yet (1.00 at 1024)", "",
           "Tokens attended: per decode step and layer, the mean over all 30 layers, so the "
           "two dense layers of scout, quest and infinigen (2048+ tokens each) add about 137 "
           "to the budget; hgca's includes the host entries it selects.", "",
           "| budget | strategy | accuracy (4 keys) | tokens attended (accel + host) |",
           "|---|---|---|---|"]
    rank = []
    for b in budgets:
        rows = [r for r in others if _budget(r) == b] + [r for r in mine if _budget(r) == b]
        rows.sort(key=lambda r: (-r["value"], _tokens(pool, r)))
        out += [f"| {b} | {_label(r)} | {r['value']:.2f} | {_tokens(pool, r):.0f} |"
                for r in rows]
        rank.append(f"- budget {b}: " + " > ".join(
            f"{_label(r)} {r['value']:.2f} ({_tokens(pool, r):.0f} tok)" for r in rows))
    out += ["", "Ranking (ties by fewer tokens attended):", "", *rank, "",
            "Paper: PassageRetrieval is one of Fig. 7's eight LongBench tasks (not reported "
            "separately in the text); Quest Table 1 (10K passkey, LongChat-7B): quest "
            "65-100% at budgets 32-512."]
    return out


def speed_table(records: list[dict]) -> list[str]:
    rows = pick(records, "tbt", mode="generate")
    if not rows:
        return ["(speed.jsonl not run)"]
    out = ["| strategy | setting | tbt p50 | decode tokens/s | accelerator idle share | "
           "bookkeeping share | host tokens/layer |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["params"]
        setting = "" if r["name"] != "scout" else (
            "precompute" if p.get("precompute") else "no precompute") + (
            ", recall" if p.get("recall") else ", no recall")
        get = {m: pick(records, m, r["name"], **p) for m in (
            "decode_tokens_per_s", "accel_idle_share", "bookkeeping_share")}
        host = pick(records, "tokens_attended_per_step", r["name"], **{**p, "where": "host"})
        cells = [f"{get[m][0]['value']:.3f}" if get[m] else "-" for m in get]
        cells.append(f"{host[0]['value']:.0f}" if host else "-")
        out.append(f"| {r['name']} | {setting} | {r['value'] * 1e3:.0f} ms | "
                   + " | ".join(cells) + " |")
    out += ["| paper Fig. 11 (Qwen3-14B, GPU) | scout / HGCA / InfiniGen | | | "
            "idle 6% / 57% / 61% | | |",
            "| paper Fig. 12 | PC 1.39x, PR a further 1.20x | | | | | |"]
    return out


def projected_table() -> list[str]:
    """PROJECTED: speed.jsonl's runs re-timed by `kvbench project --hardware
    a100-80gb-pcie4` (projected.jsonl)."""
    path = HERE / "projected.jsonl"
    if not path.exists():
        return ["(not projected)"]
    recs = [r for r in load(path).records if r["provenance"] == "projected"]
    out = ["| strategy | setting | projected tbt | projected accelerator idle share |",
           "|---|---|---|---|"]
    for r in pick(recs, "tbt"):
        p = {k: v for k, v in r["params"].items() if k != "hardware"}
        idle = pick(recs, "accel_idle_share", r["name"], **p)
        setting = "" if r["name"] != "scout" else (
            "precompute" if p.get("precompute") else "no precompute")
        out.append(f"| {r['name']} | {setting} | {r['value'] * 1e3:.2f} ms | "
                   + (f"{idle[0]['value']:.2f} |" if idle else "- |"))
    return out


def paper_shape_table() -> list[str]:
    """PROJECTED at Figs. 8, 9 and 11's model (projected-paper-shape.jsonl): the same runs
    scaled to Qwen3-14B on a100-80gb-pcie4, 8K-64K tokens at batch 1 and batch 4-64 at
    32K, with the bookkeeping carried as measured here and dropped (`--bookkeeping none`):
    decode tokens/s and accelerator idle share, "carried / dropped" per cell."""
    path = HERE / "projected-paper-shape.jsonl"
    if not path.exists():
        return ["(not projected)"]
    from kvbench.models import get_spec

    spec = get_spec("qwen3-14b")
    kv_tok = spec.kv_bytes_per_token(2)
    weights = spec.params() * 2
    v: dict[tuple, float] = {}
    for r in load(path).records:
        if r.get("provenance") != "projected" or r["metric"] not in (
                "decode_tokens_per_s", "accel_idle_share"):
            continue
        p = r["params"]
        name = r["name"] if r["name"] != "scout" or p.get("precompute") else "scout (no PC)"
        bound = "none" if "dropped" in r["method"].get("carried_over", "") else "measured"
        v[(name, p["prompt_len"], p["batch"], r["metric"], bound)] = r["value"]
    names = ["full", "hgca", "infinigen", "scout", "scout (no PC)"]
    shapes = sorted({(k[1], k[2]) for k in v})

    def cell(name: str, ctx: int, b: int, metric: str, fmt: str) -> str:
        got = [v.get((name, ctx, b, metric, bound)) for bound in ("measured", "none")]
        return " / ".join("-" if x is None else format(x, fmt) for x in got)

    out = ["decode tokens/s, bookkeeping carried / dropped (full: * where weights plus KV "
           "exceed the GPU's 80 GB, so full attention could not run there):", "",
           "| context | batch | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    for ctx, b in shapes:
        fits = weights + kv_tok * ctx * b <= 80 * 2 ** 30
        out.append(f"| {ctx // 1024}K | {b} | " + " | ".join(
            cell(n, ctx, b, "decode_tokens_per_s", ".1f") + ("" if fits or n != "full" else " *")
            for n in names) + " |")
    out += ["", "accelerator idle share, bookkeeping carried / dropped (paper Fig. 11: "
            "HGCA 57%, InfiniGen 61%, Scout 6%):", "",
            "| context | batch | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    for ctx, b in shapes:
        out.append(f"| {ctx // 1024}K | {b} | " + " | ".join(
            cell(n, ctx, b, "accel_idle_share", ".2f") for n in names) + " |")
    return out


def main() -> None:
    raw = [HERE / n for n in RAW if (HERE / n).exists()]
    for p in raw:
        for w in load(p).warnings:
            print(f"{p.name}: {w}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        # accuracy runs (511 steps): only the per-layer traces their tables read
        acc = [p for p in raw if p.name in ACCURACY]
        narrow = Path(tmp) / "accuracy.jsonl"
        slim(acc, narrow, ("trace.q_cosine", "trace.pred_error", "trace.pred_overlap"))
        recs = slim([*(p for p in raw if p.name not in ACCURACY), *([narrow] if acc else []),
                     carried(raw, Path(tmp) / "carried.jsonl"),
                     paper_shape(Path(tmp) / "paper.jsonl")], HERE / "summary.jsonl.gz", KEEP)
    md = ["# ScoutAttention on the bundled SmolLM2-135M (issue 13)", "",
          "Generated by `render.py` from `summary.jsonl`; commands in `suites/scout-*.toml`.",
          "", DIFF, "",
          "## 1. Query prediction (paper Table 1)", "", *query_table(recs), "",
          "## 2. CPU compute ratio per step (paper Fig. 6)", "",
          "Ratio = tokens attended on the host / budget, mean over the 28 sparse layers per "
          "step; prompt 1024, 96 teacher-forced steps, budget 256 in blocks of 32.", "",
          *ratio_table(recs), "",
          "Reading: at this scale the ratio is above tau = 12% from the first steps in "
          "almost every sparse layer, so the calibration gives R_l = 1 (recall every step) "
          "where the paper found 8.7. The budget here is 8 blocks (the paper's is 64), so "
          "one block is 12.5% of it: the block that leaves the window when a new one starts "
          "is host-only once the resident set is full (kvbench's rule for new blocks, an "
          "open choice of the paper) and is usually selected. Recall every step still "
          "leaves about 10% on the host: the blocks the next query picks that the last "
          "one did not. Less on the host also means less attention with the predicted "
          "query: perplexity (same tokens, no full-attention run at this length) drops "
          "from the no-recall case to the recall case.", "",
          "## 3. Accuracy vs budget: perplexity (whole-text protocol, 512 tokens) and "
          "passkey (paper Fig. 7)", "",
          "Equal budgets in tokens per decode step and layer: scout's and quest's "
          "--budget-tokens (blocks/pages of 16, the current one included), infinigen's cap "
          "on prefetched tokens, hgca's --gpu-tokens window (it also attends the host "
          "entries it selects); each row states the tokens it attended.", "",
          *ppl_table(recs), "",
          "### The error the predicted query adds, per layer", "",
          "With --pred-error each sparse layer's output is also computed as --no-precompute "
          "would: the real query selects the blocks and every selected block is attended "
          "with it. Output error = ||out - out_real|| / ||out_real|| over the batch and "
          "heads; block overlap = share of the real query's blocks (window included) that "
          "the predicted query also selected; means over decode steps.", "",
          *pred_error_table(recs), "",
          "### Passkey retrieval (2048 tokens, depth 0.5)", "", *passkey_table(recs), "",
          "## 4. Decode time and accelerator idle share, batch 1, CPU only (not Fig. 11)", "",
          "Measured with the accelerator role on the CPU (`kvbench suite run "
          "suites/scout-speed.toml` under `chrt -f 10`, one after another in one sweep, with "
          "a test suite running beside it, "
          "prompt 1024, budget 256): the host worker and the 'accelerator' share the "
          "2 cores, so moving attention to the host adds work instead of overlapping it and "
          "every strategy is slower than full here; idle shares and times are this "
          "machine's, not a GPU's.", "",
          *speed_table(recs), "",
          "### PROJECTED onto an A100 80GB on PCIe 4.0 (`kvbench project speed.jsonl "
          "--hardware a100-80gb-pcie4 --out projected.jsonl`)", "",
          "The paper's set-up is an 80 GB HBM GPU on PCIe 4.0 x16 with a 36-core CPU; the "
          "profile's host is HGCA's 2x32-core Xeon. The same runs as above (SmolLM2-135M, "
          "1024 tokens), re-timed: the accelerator and host parts of a scout or hgca layer "
          "overlap (forks), but the strategies' Python bookkeeping is carried over as this "
          "VM's measured seconds, unscaled, and on a 135M model at 1K tokens it outweighs "
          "the attention itself: scout's and hgca's host side (bookkeeping run on the host "
          "thread) sets their step and leaves the accelerator idle 85-91%, the opposite of "
          "Fig. 11's 6% for scout. "
          "Not a reproduction of Fig. 11: a model of the bookkeeping on the target's CPU "
          "and the paper's model size are missing.", "", *projected_table(), "",
          "### PROJECTED at the paper's model and lengths (Figs. 8, 9, 11): Qwen3-14B, "
          "8K-64K tokens at batch 1 and batch 4-64 at 32K, A100 80GB PCIe 4.0", "",
          "The same runs scaled (`kvbench project speed.jsonl --hardware a100-80gb-pcie4 "
          "--model qwen3-14b --prompt-len L --batch B --gen-len 16 --bookkeeping "
          "measured|none --out projected-paper-shape.jsonl`, one call per L, B and bound): "
          "dense work recomputed for "
          "Qwen3-14B, the strategies' selection shares (tokens attended and moved per step "
          "and layer as a share of the context) carried over from the 1K-token runs "
          "(budget 256 of 1024, 25%; the paper's budget 2048 is 12.5% of 16K). Two bounds "
          "for the bookkeeping (the strategies' Python and small ops) this VM measured: "
          "carried as measured, on the critical path; and dropped, as if it ran hidden "
          "behind the GPU. Differences from the paper: HGCA's 2x32-core Xeon for the host "
          "(the paper: 36 cores), our selection shares, no memory limit on the batch (the "
          "paper fills the GPU; Fig. 8: scout 5.1x FullKV at 64K, up to 2.1x HGCA and "
          "InfiniGen, both below FullKV at 8K; Fig. 9, 32K: batch 16 to 32 HGCA 1.31x, "
          "InfiniGen 1.21x, Scout 1.78x, 32 to 64 Scout 1.48x).",
          "", *paper_shape_table(), ""]
    (HERE / "table.md").write_text("\n".join(md))
    subprocess.run([sys.executable, "-m", "kvbench.cli", "report", str(HERE / "summary.jsonl.gz"),
                    "--format", "html", "--out", str(HERE / "report")], check=True)


def paper_shape(out: Path) -> Path:
    """The paper-shape projections' tokens/s and idle share (their environment lines kept)
    for the report: the other projected metrics would triple its size."""
    src = HERE / "projected-paper-shape.jsonl"
    lines = src.read_text().splitlines() if src.exists() else []
    keep = ("decode_tokens_per_s", "accel_idle_share")
    out.write_text("".join(x + "\n" for x, r in zip(lines, map(json.loads, lines), strict=True)
                           if r.get("kind") == "env" or r.get("metric") in keep))
    return out


def carried(raw: list[Path], out: Path) -> Path:
    """The previous summary's records of the suites whose raw file is absent (with the
    environment lines they name), written to `out` for slim to copy."""
    old = HERE / "summary.jsonl.gz"
    present = {RAW[p.name] for p in raw}
    docs = [(x, json.loads(x)) for x in (read_lines(old) if old.exists() else [])]
    keep = {i for i, (_, r) in enumerate(docs) if r.get("kind") == "run"
            and r.get("provenance") != "projected"  # re-read from their own files
            and r.get("method", {}).get("suite") not in present}
    envs = {docs[i][1].get("env_id") for i in keep}
    fresh = {json.loads(x).get("env_id") for p in raw for x in p.read_text().splitlines()
             if json.loads(x).get("kind") == "env"}
    keep |= {i for i, (_, r) in enumerate(docs) if r.get("kind") == "env"
             and r.get("env_id") in envs - fresh}
    out.write_text("".join(x + "\n" for i, (x, _) in enumerate(docs) if i in keep))
    return out


if __name__ == "__main__":
    main()
