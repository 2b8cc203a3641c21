"""Render issue 13's experiments (suites/scout-*.toml) beside ScoutAttention's figures.

Usage: PYTHONPATH=. .venv/bin/python results/scout/render.py
Reads query.jsonl, ratio.jsonl, ppl.jsonl and speed.jsonl beside this file when present (raw suite
outputs, kept local: per-layer traces of every quantity) and intervals.json (the
calibrated R_l); writes summary.jsonl (every record but the traces; the decode traces of
q_cosine, cpu_ratio and pages kept) and table.md.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from kvbench.store import load, slim

HERE = Path(__file__).parent
KEEP = ("trace.q_cosine", "trace.cpu_ratio", "trace.pages")
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


def ppl_table(records: list[dict]) -> list[str]:
    """Scout at budget 64 beside full and quest from the page-sparse suite (same protocol)."""
    base = HERE.parent / "page-sparse" / "summary.jsonl"
    others = [json.loads(line) for line in base.read_text().splitlines()] if base.exists() \
        else []
    proto = {"mode": "eval", "prompt_len": 1, "gen_len": 511}
    full = pick([r for r in others if r.get("kind") == "run"], "perplexity", **proto)
    full = [r for r in full if r["name"] == "full"]
    rows = [r for r in pick([r for r in others if r.get("kind") == "run"], "perplexity",
                            **proto, budget_tokens=64) if r["name"] == "quest"]
    rows += pick(records, "perplexity", **proto)
    if not full or len(rows) < 2:
        return ["(not run: suites/scout-ppl.toml was stopped for the session's time; its "
                "two 511-step cases did not finish on the loaded machine)"]
    f = full[0]["value"]
    out = [f"Full attention: {f:.3f} (results/page-sparse)", "",
           "| strategy | setting | perplexity | vs full | tokens attended (accel + host) | "
           "host share | top-10 recall |", "|---|---|---|---|---|---|---|"]
    pool = records + [r for r in others if r.get("kind") == "run"]
    for r in rows:
        p = r["params"]
        tok = [x["value"] for x in pool if x["metric"] == "tokens_attended_per_step"
               and x["name"] == r["name"] and all(x["params"].get(k) == v for k, v in
                                                  p.items() if k != "where")]
        ratio = pick(records, "cpu_compute_ratio_per_step", **p) if r["name"] == "scout" \
            else []
        top = [x["value"] for x in pool if x["metric"] == "top10_recall"
               and x["name"] == r["name"] and x["params"] == p]
        setting = "pages of 16, per query head" if r["name"] == "quest" else (
            "blocks of 16, " + ("predicted query on the host" if p.get("precompute") else
                                "no precompute (real query)"))
        out.append(f"| {r['name']} | {setting} | {r['value']:.3f} | "
                   f"{r['value'] / f - 1:+.1%} | {sum(tok):.0f} | "
                   f"{statistics.fmean(ratio[0]['samples']) if ratio else 0:.1%} | "
                   f"{top[0] if top else float('nan'):.2f} |")
    out += ["", "Paper Fig. 7 (LongBench accuracy, Qwen3-8B, not perplexity): scout within "
            "2.5% of full at budget 1024 and 2.1% at 2048 (the abstract says 2.4%, the "
            "introduction under 2.1%); slightly below InfiniGen."]
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


def main() -> None:
    raw = [HERE / n for n in ("query.jsonl", "ratio.jsonl", "ppl.jsonl", "speed.jsonl")
           if (HERE / n).exists()]
    for p in raw:
        for w in load(p).warnings:
            print(f"{p.name}: {w}", file=sys.stderr)
    recs = slim(raw, HERE / "summary.jsonl", KEEP)
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
          "## 3. Perplexity at budget 64 (whole-text protocol, 512 tokens)", "",
          *ppl_table(recs), "",
          "## 4. Decode time and accelerator idle share, batch 1, CPU only (not Fig. 11)", "",
          "Measured with the accelerator role on the CPU: the host worker and the "
          "'accelerator' share 2 loaded cores, so idle shares and times are this machine's, "
          "not a GPU's; with load averages of 20-40 on the 2 cores while these ran, the "
          "step times of different runs are not comparable to each other either.", "",
          *speed_table(recs), ""]
    (HERE / "table.md").write_text("\n".join(md))


if __name__ == "__main__":
    main()
