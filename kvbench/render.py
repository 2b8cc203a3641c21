"""Terminal rendering of the env record, the registry listing and compare results."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from rich.table import Table

from kvbench.compare import Row, common_shift, rows_to_json
from kvbench.console import console, markdown_table, params_text
from kvbench.units import format_bytes


def env_tables(env: dict[str, Any]) -> None:
    cpu = env["cpu"]
    console.print(f"[bold]CPU[/] {cpu['model']} ({cpu['arch']}), {cpu['logical_cpus']} logical "
                  f"CPUs, {cpu['physical_cores'] or '?'} cores, governor {cpu['governor'] or '?'}")
    caches = ", ".join(f"L{c['level']} {c['type'].lower()} {c['size']}" for c in cpu["caches"])
    console.print(f"[bold]Caches[/] {caches or 'unknown'}")
    t = Table(title="NUMA nodes")
    for col in ("node", "CPUs", "memory", "distances", "kind"):
        t.add_column(col)
    for n in env["numa_nodes"]:
        cpus = n["cpus"]
        span = f"{cpus[0]}-{cpus[-1]} ({len(cpus)})" if cpus else "-"
        kind = "[magenta]memory-only[/]" if n["memory_only"] else "cpu+memory"
        t.add_row(str(n["id"]), span, format_bytes(n["mem_total_bytes"]),
                  " ".join(map(str, n["distances"])), kind)
    console.print(t)
    if env["cxl_devices"]:
        console.print("[bold]CXL devices[/] " + ", ".join(
            d["name"] + (f" (node {d['numa_node']})" if "numa_node" in d else "")
            for d in env["cxl_devices"]))
    if env["gpus"]:
        g = Table(title="GPUs")
        for col in ("#", "name", "memory", "PCIe now", "PCIe max", "NUMA", "driver"):
            g.add_column(col)
        for d in env["gpus"]:
            g.add_row(str(d["index"]), d["name"], f"{d['memory_bytes'] / 1e9:.1f} GB",
                      f"gen{d.get('pcie_gen', '?')} x{d.get('pcie_width', '?')}",
                      f"gen{d.get('pcie_gen_max', '?')} x{d.get('pcie_width_max', '?')}",
                      str(d.get("numa_node")), str(d.get("driver", "?")))
        console.print(g)
    else:
        console.print("[bold]GPUs[/] none")
    console.print(f"[bold]Native kernel[/] {env.get('native_kernel', 'unknown')}")
    v = env["versions"]
    console.print("[bold]Versions[/] " + ", ".join(f"{k} {val}" for k, val in v.items()))
    console.print(f"[bold]git[/] {env['git_commit']}{' (dirty)' if env['git_dirty'] else ''}  "
                  f"[bold]env_id[/] {env['env_id']}")
    for note in env["notes"]:
        console.print(f"[yellow]note:[/] {note}")


def markdown_tables() -> str:
    """The probes and the strategies as two Markdown tables (name, what it measures or does),
    from the registries: what `kvbench list --markdown` prints and README.md embeds."""
    from kvbench.probes import PROBES
    from kvbench.strategies import STRATEGIES

    out = []
    for reg, what in ((PROBES, "what it measures"), (STRATEGIES, "what it does")):
        out += markdown_table([reg.kind, what], [[f"`{c.name}`", c.summary()]
                                                 for c in reg.all()])
        out.append("")
    return "\n".join(out[:-1])


def listing(as_json: bool) -> None:
    from kvbench.models import MODELS
    from kvbench.probes import PROBES
    from kvbench.strategies import STRATEGIES, variants

    entries = [{"kind": reg.kind, "name": c.name, "version": c.version, "summary": c.summary()}
               for reg in (PROBES, STRATEGIES) for c in reg.all()]
    for e, c in zip(entries[len(PROBES.all()):], STRATEGIES.all(), strict=True):
        if names := [v.name for v in variants(c.params)]:
            e["variants"] = names
            e["summary"] += f" (variants: {', '.join(names)})"
    entries += [{"kind": "model", "name": m.name, "version": "", "params": m.params(),
                 "kv_bytes_per_token": m.kv_bytes_per_token(),
                 "summary": f"{m.family}: {m.params() / 1e9:.3g}B params, KV "
                            f"{format_bytes(m.kv_bytes_per_token())}/token (16-bit), "
                            f"{m.n_layers} layers, {m.n_heads}/{m.n_kv_heads} q/kv heads, "
                            f"context {m.ctx}"} for m in MODELS.values()]
    if as_json:
        print(json.dumps(entries, indent=2))
        return
    t = Table()
    for col in ("kind", "name", "version", "summary"):
        t.add_column(col)
    for e in entries:
        t.add_row(e["kind"], e["name"], e["version"], e["summary"])
    console.print(t)


_VERDICT_STYLE = {"regressed": "bold red", "error": "bold red", "improved": "green",
                  "noise": "yellow", "missing": "dim", "added": "dim", "unmeasured": "dim"}


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _cells(r: Row) -> list[str]:
    change = "-" if r.change is None else f"{r.change:+.1%}"
    p = "-" if r.p_value is None else f"{r.p_value:.3g}"
    noise = "-" if r.noise is None else f"\u00b1{r.noise:.1%}"
    label = r.metric + ("" if r.provenance == "measured" else " (projected)")
    return [r.name, params_text(r.params), label, r.unit, _fmt(r.base), _fmt(r.new), change, p,
            noise, r.test, r.verdict, "; ".join(r.marks)]


_HEAD = ["name", "params", "metric", "unit", "base", "new", "change (+ better)", "p",
         "run noise", "test", "verdict", "marks"]
_VERDICT = _HEAD.index("verdict")


def compare_output(rows: list[Row], fmt: str, threshold: float, alpha: float) -> None:
    bad = sum(r.verdict in ("regressed", "error") for r in rows)
    calibrated = sum(r.noise is not None for r in rows)
    summary = (f"{len(rows)} quantities, {bad} regressed, "
               f"{sum(r.verdict == 'improved' for r in rows)} improved "
               f"(threshold {threshold:.1%}, Mann-Whitney U at alpha {alpha:g} over the "
               f"{sum(r.p_value is not None for r in rows)} tested (Benjamini-Hochberg)"
               + (f"; {calibrated} judged against calibrated run-to-run noise" if calibrated
                  else "") + ")")
    shift = common_shift(rows, threshold)
    if shift is not None:
        summary += (f"\nAll together: {shift.moved} of {shift.judged} quantities moved the "
                    f"same way (median {shift.median:+.1%}), as a change of the machine's "
                    "speed between the runs does; only a calibration (--noise) or base and "
                    "new re-run interleaved tells that from a change of the code.")
    if fmt == "json":
        print(json.dumps({"threshold": threshold, "alpha": alpha, "regressions": bad,
                          "common_shift": asdict(shift) if shift else None,
                          "rows": rows_to_json(rows)}, indent=2, default=str))
    elif fmt == "markdown":
        print("\n".join(markdown_table(_HEAD, [_cells(r) for r in rows])))
        print(f"\n{summary}")
    else:
        t = Table()
        for col in _HEAD:
            t.add_column(col)
        for r in rows:
            cells = _cells(r)
            style = _VERDICT_STYLE.get(r.verdict)
            if style:
                cells[_VERDICT] = f"[{style}]{cells[_VERDICT]}[/]"
            t.add_row(*cells)
        console.print(t)
        console.print(summary)
