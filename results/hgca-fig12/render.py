"""HGCA Fig. 12 as a projection: decode tokens/s of offload (FlexGen-style), H2O and HGCA
for OPT-6.7B/13B/30B, prompt 1920, 128 generated tokens, batch 1..32 on the RTX A6000 /
PCIe 4.0 profile, projected from runs on the bundled model (run.sh). Writes table.md.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from kvbench.store import load

HERE = Path(__file__).parent
STRATEGIES = ("offload", "h2o", "hgca")


def _table(path: Path) -> dict[tuple[str, int], dict[str, float]]:
    out: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
    if not path.exists():
        return out
    for r in load(path).records:
        if r.get("kind") == "run" and r.get("metric") == "decode_tokens_per_s" \
                and r.get("provenance") == "projected":
            out[(r["params"]["model"], int(r["params"]["batch"]))][r["name"]] = r["value"]
    return out


def main() -> None:
    none = _table(HERE / "projected-none.jsonl")
    meas = _table(HERE / "projected-measured.jsonl")
    rows = ["| model | batch | " + " | ".join(f"{s} tokens/s" for s in STRATEGIES)
            + " | HGCA / offload | HGCA / H2O |", "|---" * (len(STRATEGIES) + 4) + "|"]
    for (model, batch), v in sorted(none.items(), key=lambda kv: (float(kv[0][0][4:-1]),
                                                                  kv[0][1])):
        m = meas.get((model, batch), {})
        cells = [f"{v.get(s, float('nan')):.1f} ({m.get(s, float('nan')):.1f})"
                 for s in STRATEGIES]
        ratio = [f"{v['hgca'] / v[b]:.2f}x" if "hgca" in v and b in v else "-"
                 for b in ("offload", "h2o")]
        rows.append(f"| {model} | {batch} | " + " | ".join(cells + ratio) + " |")
    text = "\n".join([
        "# HGCA Fig. 12 as a projection (issue 14)",
        "",
        "Projected decode tokens/s on the `a6000-pcie4` profile (RTX A6000, PCIe 4.0 x16,",
        "2x Xeon Gold 6430: HGCA section 5's platform) for OPT-6.7B/13B/30B, prompt 1920,",
        "128 generated tokens, fp16. Every figure is projected (`kvbench project --model`)",
        "from a run on the bundled SmolLM2-135M here (prompt 32, 8 decode steps, batch 1;",
        "`source.jsonl`, the validation suite's runs) with its selection statistics carried",
        "over: offload copies every layer's KV from the host (100% on the host, InfiniGen's",
        "set-up the paper follows), H2O keeps 20% of the KV (the paper's setting), HGCA keeps",
        "25% on the GPU (the paper: 5%) and, at beta 0, attends every host entry on the CPU",
        "(no sparsification: the slowest HGCA setting).",
        "First number: bookkeeping without a work model dropped (`--bookkeeping none`, the",
        "GPU implementation's MAW update and selection run off the critical path); in",
        "brackets: the bookkeeping seconds measured on this 2-core CPU VM carried over as",
        "they are (a CPU-bound upper bound).",
        "",
        *rows,
        "",
        "## The paper's Fig. 12 beside ours",
        "",
        "The paper's text does not give Fig. 12's numbers (they are only in the figure",
        "image, which the text we have does not contain); what it states (section 5.2):",
        "HGCA consistently outperformed FlexGen and H2O at every batch size, because of their",
        "KV loading and LRU-based eviction; InfiniGen was comparable but ran out of memory",
        "(not projected here: its memory is not modelled). Compare the ratio columns with",
        "that claim.",
        "",
        "Differences from the paper's set-up, stated:",
        "- The paper keeps 75% of OPT-30B's weights on the GPU (and 25% of OPT-66B's), with",
        "  FlexGen swapping the rest; the projection assumes every weight resident (60 GB of",
        "  fp16 weights for OPT-30B do not fit a 48 GB A6000): weight swapping is not modelled.",
        "- Batches are not cut at each method's memory limit; the paper stops each method",
        "  at the largest batch it fits.",
        "- The selections come from 40-token contexts on SmolLM2 (the validation runs; a",
        "  dedicated run at the paper's 5% GPU share and a 512-token prompt did not get CPU",
        "  time on the loaded machine): the share of the context each strategy attends or",
        "  moves is assumed to stay the same at 1920 tokens on OPT; HGCA at 25% GPU share and",
        "  beta 0 does more host work than the paper's 5% with sparsification.",
        "- kvbench's h2o keeps its 20% on the accelerator and drops the rest (no transfers);",
        "  the paper's H2O runs inside FlexGen with the KV starting on the host and loaded on",
        "  demand, so its loading cost, which the paper names as H2O's overhead, is absent",
        "  here: our projection has HGCA behind H2O (ratio < 1), unlike the paper's claim.",
        "- Profile figures marked 'estimate' in `kvbench hardware show a6000-pcie4` (PCIe",
        "  efficiency, kernel efficiency, CPU attention GB/s) were not measured on an A6000.",
        ""])
    (HERE / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
