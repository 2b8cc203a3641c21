"""Render issue 11's speed bars (items 1 and 2) from the result files beside this file.

Usage: .venv/bin/python results/wave1-speed/render.py   (writes table.md)
attention-*.jsonl: `kvbench probe attention --modes cpu-dense --query 1` per head shape
(commands in each record); decode-vs-hf*.jsonl: `kvbench run full --compare-hf` at batch 1 and 8.
"""

from __future__ import annotations

from pathlib import Path

from kvbench.store import load

HERE = Path(__file__).parent
ATTN = ("kv_read_gbps", "host_read_gbps", "bar.cpu_dense_over_host_read",
        "bar.sdpa_time_over_cpu_dense_time")


def spread(r: dict) -> str:
    s = r.get("stats") or {}
    if "p10" not in s or s["p10"] == s["p90"]:
        return f"{r['value']:.2f}"
    return f"{r['value']:.2f} ({s['p10']:.2f}-{s['p90']:.2f})"


def attention_rows() -> list[str]:
    cells: dict[tuple, dict[str, dict]] = {}
    for path in sorted(HERE.glob("attention-*.jsonl")):
        for r in load(path).records:
            if r["metric"] in ATTN and r["status"] == "ok":
                p = r["params"]
                key = (p["heads"], p["kv_heads"], p["head_dim"], p["dtype"], p["host_tokens"])
                cells.setdefault(key, {})[r["metric"]] = r
    rows = ["| heads / KV heads x dim | dtype | tokens | CPU dense KV read GB/s | read loop "
            "GB/s | dense / read loop (goal >= 0.85) | SDPA time / ours (bar >= 1.0) |",
            "|---|---|---|---|---|---|---|"]
    for (h, hk, d, dt, n), c in sorted(cells.items()):
        rows.append(f"| {h}/{hk} x {d} | {dt} | {n // 1024}K | "
                    + " | ".join(spread(c[m]) if m in c else "-" for m in ATTN) + " |")
    return rows


def decode_rows() -> list[str]:
    rows = ["| file | commit | batch | kvbench tokens/s | transformers tokens/s | kvbench / "
            "transformers (bar >= 1.2) |", "|---|---|---|---|---|---|"]
    for path in sorted(HERE.glob("decode-vs-hf*.jsonl")):
        rs = [r for r in load(path).records if r["kind"] == "run"]
        for b in sorted({r["params"]["batch"] for r in rs}):
            m = {r["metric"]: r for r in rs if r["params"]["batch"] == b}
            rows.append(f"| {path.name} | {rs[0]['git_commit'][:7]} | {b} | " + " | ".join(
                spread(m[k]) if k in m else "-" for k in
                ("decode_tokens_per_s", "hf_decode_tokens_per_s", "decode_speed_vs_hf")) + " |")
    return rows


def main() -> None:
    attn_rs = load(HERE / "attention-8x8.jsonl")
    env = next(iter(attn_rs.envs.values()))
    attn = next(r for r in attn_rs.records if r["metric"] == "kv_read_gbps")
    lines = ["# Issue 11 speed bars: CPU attention vs SDPA and the read roof; decode vs "
             "transformers", "",
             f"Machine: {env.get('cpu', {}).get('model', '?')}, "
             f"{env.get('cpu', {}).get('logical_cpus', '?')} CPUs, torch "
             f"{env.get('versions', {}).get('torch', '?')}; medians with p10-p90 of "
             "interleaved rounds, timed in 8 passes over each run (per-round ratios for "
             f"the bars; attention probe version {attn['version']}, commit "
             f"{attn['git_commit'][:7]}). Runs under "
             "`chrt -f 10` (SCHED_FIFO) to shield them from niced background jobs on the "
             "shared 2-core VM.", "", "## CPU dense decode attention (item 1)", "",
             *attention_rows(), "", "## Decode vs transformers `generate` (item 2)", "",
             "Bundled model (smollm2-135m), fp32, 2 threads, prompt 256, 32 decode steps; "
             "decode-vs-hf-gcoff.jsonl: both decoders timed with the cyclic GC off (3e395b2 "
             "with that change, committed as e02717b; "
             "the machine was slower then: read the ratios).",
             "", *decode_rows(), ""]
    (HERE / "table.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
