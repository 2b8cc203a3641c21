"""The opening of a report: the machine in one line, the headline figures, the runs compared.

A reader first wants the answer, then the detail (issue 11 item 15): `summarize` turns the
loaded records into
- one line per environment (CPU, memory, NUMA nodes, GPUs or "accelerator role on the CPU");
- headline rows per probe and strategy: peak copy GB/s per memory pair, CPU dense
  attention's KV-read GB/s against the host copy measured in the same run, decode
  tokens/s (with the share of its bytes bound it reached) and perplexity against full
  attention per run;
- one comparison table with the runs side by side (one row per strategy and setting): TTFT,
  TBT p50/p90, tokens/s, peak memory, perplexity and its change against full attention at
  the same run settings, tokens attended per step and layer, bytes per step per link, and
  the accelerator role's idle share, the step's bytes bound and the share of it reached
  (kvbench.runtime.bound), torch ops and syncs per decode step (kvbench.runtime.opcount);
- a figure of the per-layer work traces (mean per decode step, one line per run and place).
Where the accelerator role ran on the CPU, every label says `accel (cpu)`.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.units import format_bytes

REFERENCE = "full"  # the strategy every perplexity is compared with
RUN_OPTIONS = ("model", "weights", "layers", "layers_total", "batch", "prompt_len", "gen_len",
               "turns", "mode", "dtype", "accel", "threads", "text")
COLUMNS = ["strategy", "settings", "ttft", "tbt p50", "tbt p90", "tokens/s", "peak memory",
           "perplexity", "vs full", "tokens attended / step / layer", "bytes / step",
           "accel idle", "step bound", "of bound", "ops / step", "syncs / step"]
TRACES = ("tokens", "bytes_moved", "time", "rel_error")  # per-layer figure panels


@dataclass
class Summary:
    machines: list[str] = field(default_factory=list)
    headlines: list[list[str]] = field(default_factory=list)  # [what, figure, detail]
    common: str = ""  # the settings every compared run shares
    runs: list[list[str]] = field(default_factory=list)  # rows under COLUMNS
    traces: Path | None = None
    by_machine: list[list[str]] = field(default_factory=list)  # header row, then headlines
    # headline metrics against the parameter the sweep varies (kvbench.present.sweep):
    # (title, header, rows); notes: metrics that could not be pivoted
    sweeps: list[tuple[str, list[str], list[list[str]]]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def accel_label(accel: Any) -> str:
    """'accel (cpu)' or 'accel (cuda)': the accelerator role and what it ran on."""
    return f"accel ({accel or '?'})"


def place(where: str, params: dict[str, Any]) -> str:
    """A record's `where` as a reader sees it: the accelerator role says where it ran."""
    return accel_label(params.get("accel")) if where == "accel" else where


def machine_line(env: dict[str, Any]) -> str:
    cpu = env.get("cpu", {})
    gpus = env.get("gpus") or []
    nodes = env.get("numa_nodes") or []
    gpu = (", ".join(g["name"] for g in gpus) if gpus
           else "no GPU (the accelerator role runs on the CPU)")
    torch = (env.get("versions") or {}).get("torch", "?")
    return (f"{cpu.get('model', '?')} ({cpu.get('arch', '?')}), {cpu.get('logical_cpus', '?')} "
            f"logical CPUs, {format_bytes(env.get('memory_bytes') or 0)}, {len(nodes)} NUMA "
            f"node(s); {gpu}; torch {torch}")


def reference_value(refs: dict[tuple, float], params: dict[str, Any]) -> float | None:
    """The reference value at exactly these parameters, else at a subset of them (the
    reference lacks the strategy's own parameters). refs: sorted param items -> value."""
    shared = tuple(sorted(params.items(), key=str))
    return refs.get(shared) or next((v for k, v in refs.items() if set(k) <= set(shared)),
                                    None)


def _perplexities(ok: list[dict[str, Any]]) -> dict[tuple, float]:
    return {tuple(sorted(r["params"].items(), key=str)): r["value"] for r in ok
            if r["name"] == REFERENCE and r["metric"] == "perplexity"}


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value:.3g} s" if value >= 1 else f"{value * 1e3:.3g} ms"
    if unit == "B":
        return format_bytes(value)
    if unit == "ratio":
        return f"{value:.1%}"
    return f"{value:.3g}"


def _run_key(r: dict[str, Any]) -> tuple:
    return (r["name"], tuple(sorted(((k, v) for k, v in r["params"].items() if k != "where"),
                                    key=str)))


def label(r: dict[str, Any]) -> str:
    """The metric, marked when projected, and for a run's times when teacher-forced (eval
    mode: the strategy's own times, its accuracy reference ran between the timed steps)."""
    text = r["metric"] + ("" if r.get("provenance") == "measured" else " (projected)")
    if r["kind"] == "run" and r["params"].get("mode") == "eval" and r["unit"] in ("s",
                                                                                   "tokens/s"):
        text += " (eval mode)"
    return text


def _eval_mark(r: dict[str, Any]) -> str:
    return " (eval mode)" if label(r).endswith("(eval mode)") else ""


def _one(m: dict[str, list[dict[str, Any]]], metric: str, mark: bool) -> str:
    """A run's value of `metric` ('-' when not measured), marked when in eval mode (unless
    every run is: the caption says so)."""
    rec = m.get(metric, [None])[0]
    return "-" if rec is None else _fmt(rec["value"], rec["unit"]) + (
        _eval_mark(rec) if mark else "")


def _per_place(m: dict[str, list[dict[str, Any]]], metric: str, p: dict[str, Any]) -> str:
    """A run's values of `metric` per place ('accel (cpu) 56.5, host 5.5')."""
    return ", ".join(f"{place(r['params']['where'], p)} {_fmt(r['value'], r['unit'])}"
                     for r in m.get(metric, [])) or "-"


def compare_runs(ok: list[dict[str, Any]]) -> tuple[str, list[list[str]]]:
    """(settings shared by every run, one row per run under COLUMNS)."""
    runs: dict[tuple, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in ok:
        if r["kind"] == "run" and not r["metric"].startswith("trace."):
            runs[_run_key(r)][r["metric"]].append(r)
    if not runs:
        return "", []
    params = [dict(key[1]) for key in runs]
    common = {k: v for k, v in params[0].items() if all(p.get(k) == v for p in params)}
    refs = _perplexities(ok)
    rows = []
    for (name, items), m in sorted(runs.items(), key=lambda kv: (kv[0][0] != REFERENCE,
                                                                   str(kv[0]))):
        p = dict(items)
        ppl = m.get("perplexity", [None])[0]
        base = reference_value(refs, p) if ppl else None
        change = "-" if base is None or name == REFERENCE else \
            f"{(ppl['value'] - base) / base:+.2%}"
        own = " ".join(f"{k}={v}" for k, v in p.items() if k not in common)
        mark = "mode" not in common
        rows.append([name, own or "-", *(_one(m, x, mark) for x in (
                         "ttft", "tbt", "tbt_p90", "decode_tokens_per_s")),
                     _per_place(m, "peak_memory", p),
                     "-" if ppl is None else f"{ppl['value']:.4g}", change,
                     _per_place(m, "tokens_attended_per_step", p),
                     _per_place(m, "bytes_moved_per_step", p),
                     _one(m, "accel_idle_share", mark),
                     *(_one(m, x, False) for x in ("step_bound_s", "step_efficiency",
                                                   "ops_per_step", "syncs_per_step"))])
    shared = " ".join(f"{k}={v}" for k, v in common.items()
                      if k in RUN_OPTIONS and k != "accel")
    if common.get("mode") == "eval":
        shared += " (times in eval mode)"
    where = accel_label(common["accel"]) if "accel" in common else ""
    return f"{shared}; accelerator role: {where}" if where else shared, rows


def headlines(ok: list[dict[str, Any]]) -> list[list[str]]:
    """[what, figure, detail] rows: copy peaks, CPU attention vs copy, each run's speed and
    accuracy."""
    rows = []
    for r in ok:
        if r["name"] == "bandwidth" and r["metric"] == "peak_bandwidth":
            p = r["params"]
            rows.append([f"peak copy {p['src']} -> {p['dst']}", f"{r['value']:.3g} GB/s",
                         f"{p.get('memory', '')} memory, {p.get('threads', 1)} thread(s)"])
    copy = [r["value"] for r in ok if r["name"] == "attention"
            and r["metric"] == "host_copy_gbps"]
    for r in ok:
        if r["name"] == "attention" and r["metric"] == "bar.cpu_dense_over_host_copy":
            p = r["params"]
            kv = [x["value"] for x in ok if x["metric"] == "kv_read_gbps"
                  and x["params"].get("mode") == "cpu-dense"
                  and all(x["params"].get(k) == v for k, v in p.items())]
            figure = f"{r['value']:.2f}x the host copy"
            if kv and copy:
                figure += f" ({statistics.median(kv):.3g} vs {statistics.median(copy):.3g} GB/s)"
            rows.append(["CPU dense attention KV read", figure,
                         f"batch {p['batch']}, {p['heads']}/{p['kv_heads']} heads x "
                         f"{p['head_dim']}, {p['host_tokens']} host tokens, {p['dtype']}, "
                         f"{p['threads']} threads"])
    refs = _perplexities(ok)
    from kvbench.present.sweep import ALIASES, varying

    swept = varying([r for r in ok if r["kind"] == "run" and not r["metric"].startswith(
        "trace.")])
    for r in ok:
        if r["kind"] != "run":
            continue
        p = r["params"]
        keys = [x for k in sorted(swept.get(r["name"], ())) for x in ALIASES.get(k, (k,))]
        own = " ".join(f"{k}={p[k]}" for k in keys if k in p)
        what = (f"{r['name']} on {p.get('model')} ({accel_label(p.get('accel'))})"
                + (f" {own}" if own else ""))
        if r["metric"] == "decode_tokens_per_s":
            rows.append([what, f"{r['value']:.3g} tokens/s{_eval_mark(r)}",
                         f"batch {p.get('batch')}, prompt {p.get('prompt_len')}, "
                         f"{p.get('gen_len')} generated"])
        elif r["metric"] == "step_efficiency":
            m = r.get("method") or {}
            rows.append([what, f"{r['value']:.0%} of its bytes bound{_eval_mark(r)}",
                         f"step bound {_fmt(m.get('step_bound_s'), 's')} at the "
                         f"{m.get('bandwidth_source')}'s bandwidth"])
        elif r["metric"] == "perplexity":
            base = reference_value(refs, p)
            vs = "" if base is None or r["name"] == REFERENCE else \
                f" ({(r['value'] - base) / base:+.2%} vs {REFERENCE} {base:.4g})"
            rows.append([what, f"perplexity {r['value']:.4g}{vs}",
                         f"{p.get('mode')} mode, prompt {p.get('prompt_len')}, "
                         f"{p.get('gen_len')} scored steps"])
    return rows


def trace_figure(ok: list[dict[str, Any]], out_dir: Path) -> Path | None:
    """Per-layer traces of the decode steps: a panel per quantity, the mean per step
    against the layer, one line per (run, place)."""
    from kvbench.plots import pyplot, save

    lines: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    units = {}
    for r in ok:
        q = r["metric"].removeprefix("trace.")
        p = r["params"]
        if r["kind"] != "run" or q not in TRACES or p.get("phase") != "decode":
            continue
        label = f"{r['name']} {place(p['where'], p)}"
        lines[q][label][p["layer"]] = statistics.fmean(r["samples"])
        units[q] = r["unit"]
    if not lines:
        return None
    plt = pyplot()
    panels = [q for q in TRACES if q in lines]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False)
    for ax, q in zip(axes[0], panels, strict=True):
        for label, by_layer in sorted(lines[q].items()):
            xs = sorted(by_layer)
            ax.plot(xs, [by_layer[x] for x in xs], marker=".", label=label)
        ax.set_xlabel("layer")
        ax.set_ylabel(f"{q} per decode step [{units[q]}]")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("per-layer work traces (mean per decode step)")
    return save(fig, out_dir / "run-traces-per-layer.png")


def _pooled(ok: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Repetitions of one quantity as one record: samples pooled, value their median."""
    from kvbench.schema import record_key

    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in ok:
        groups[record_key(r)].append(r)
    out = []
    for recs in groups.values():
        samples = [x for r in recs for x in (r.get("samples") or [r["value"]])]
        out.append({**recs[0], "samples": samples, "value": statistics.median(samples)})
    return out


def by_machine(envs: dict[str, dict[str, Any]], ok: list[dict[str, Any]]) -> list[list[str]]:
    """The headline figures of each machine side by side, machines ordered by class: a
    header row ['headline', machine...] then one row per headline; [] for one machine."""
    from kvbench.suite import machine_label

    labels = {env_id: machine_label(env) for env_id, env in envs.items()}
    cols = sorted({labels[r["env_id"]] for r in ok if r.get("env_id") in labels})
    if len(cols) < 2:
        return []
    cells: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for col in cols:
        mine = _pooled([r for r in ok if labels.get(r["env_id"]) == col])
        for what, figure, _ in headlines(mine):
            cells[what][col].append(figure)
    return [["headline", *cols]] + [[what, *("; ".join(c.get(col, [])) or "-" for col in cols)]
                                    for what, c in cells.items()]


def summarize(envs: dict[str, dict[str, Any]], records: list[dict[str, Any]],
              out_dir: Path) -> Summary:
    ok = [r for r in records if r["status"] == "ok"]
    common, runs = compare_runs(ok)
    from kvbench.present.sweep import sweep_tables

    machines = list(dict.fromkeys(machine_line(e) for e in envs.values()))
    tables, notes = sweep_tables(ok)
    return Summary(machines, headlines(ok), common, runs, trace_figure(ok, out_dir),
                   by_machine(envs, ok), [(t.p.title, *t.grid()) for t in tables], notes)
