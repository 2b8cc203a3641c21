"""`kvbench report`: result files to tables, figures and an environment summary.

Records are grouped by (kind, name). A probe's figures come from its own `Probe.plot`; a
group with no figures of its own (or no registered probe) gets a box plot of its samples.
Runs (kind "run") get the cross-strategy figures drawn here: every guarded metric against
every numeric parameter it was swept over (throughput and time between tokens against
batch and context), one line per strategy and fixed parameters, and the accuracy table
(perplexity per strategy and parameters next to the full-attention reference, HGCA
Table 1). Projected values are dashed/hatched in figures and labelled in tables.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.console import markdown_table, params_text, value_text
from kvbench.plots import pyplot, save
from kvbench.plots.budget import budget_figures
from kvbench.schema import RecordKey, record_key
from kvbench.store import load
from kvbench.suite import machine_label
from kvbench.summary import REFERENCE, Summary, label, reference_value, summarize
from kvbench.units import format_bytes

RUN_AXES = ("batch", "context", "prompt_len")  # run parameters figures put on the x axis


@dataclass
class Figure:
    title: str
    path: Path
    commands: list[str]


@dataclass
class Group:
    """Records of one probe or strategy (kind "run" groups every strategy together)."""

    kind: str
    name: str
    records: list[dict[str, Any]]
    figures: list[Figure] = field(default_factory=list)

    @property
    def title(self) -> str:
        return "runs (all strategies)" if self.kind == "run" else f"probe {self.name}"

    def ok(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["status"] == "ok"]

    def not_ok(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["status"] != "ok"]


@dataclass
class Report:
    files: list[Path]
    envs: dict[str, dict[str, Any]]
    groups: list[Group]
    warnings: list[str]
    accuracy: list[list[str]]
    summary: Summary = field(default_factory=Summary)
    machines: dict[str, str] = field(default_factory=dict)  # env id -> label, if several

    def row(self, r: dict[str, Any]) -> list[str]:
        """record_row, the name tagged with its machine when the files hold several."""
        return record_row(r, self.machines.get(r.get("env_id", "")))


def commands(records: list[dict[str, Any]]) -> list[str]:
    return sorted({r["command"] for r in records if r.get("command")})


def _numeric_axes(records: list[dict[str, Any]]) -> list[str]:
    """RUN_AXES parameters that take at least two numeric values in these records."""
    values: dict[str, set] = defaultdict(set)
    for r in records:
        for k, v in r["params"].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                values[k].add(v)
    return [k for k in RUN_AXES if len(values.get(k, ())) > 1]


def run_figures(records: list[dict[str, Any]], out_dir: Path) -> list[Figure]:
    """Each run metric against each numeric parameter swept, a line per strategy+rest."""
    plt = pyplot()
    figs = []
    ok = [r for r in records if r["status"] == "ok" and r["direction"] != "none"
          and not re.search(r"_p\d+$", r["metric"])]  # percentiles: in the tables
    for metric in sorted({r["metric"] for r in ok}):
        recs = [r for r in ok if r["metric"] == metric]
        for axis in _numeric_axes(recs):
            series: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
            for r in recs:
                if axis in r["params"]:
                    rest = tuple((k, v) for k, v in sorted(r["params"].items()) if k != axis)
                    series[(r["name"], r["provenance"], rest)].append((r["params"][axis],
                                                                       r["value"]))
            fig, ax = plt.subplots(figsize=(6.4, 4))
            for (name, prov, rest), pts in sorted(series.items(), key=str):
                xs, ys = zip(*sorted(pts), strict=True)
                tag = f"{name} {' '.join(f'{k}={v}' for k, v in rest)}".strip()
                projected = prov == "projected"
                ax.plot(xs, ys, "--" if projected else "-", marker="o",
                        mfc="none" if projected else None,
                        label=tag + (" (projected)" if projected else ""))
            ax.set_xscale("log", base=2)
            ax.set_xlabel(axis)
            ax.set_ylabel(f"{metric} [{recs[0]['unit']}]")
            ax.set_title(f"{metric} against {axis}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
            path = save(fig, out_dir / f"run-{metric}-vs-{axis}.png")
            figs.append(Figure(f"runs: {metric} against {axis}", path, commands(recs)))
    return figs


def samples_figure(group: Group, out_dir: Path) -> list[Figure]:
    """Box plot of every ok quantity's samples, one panel per unit (generic fallback)."""
    pooled: dict[RecordKey, dict[str, Any]] = {}
    for r in group.ok():  # repetitions of one quantity are pooled into one box
        p = pooled.setdefault(record_key(r), {**r, "samples": []})
        p["samples"] = p["samples"] + (r.get("samples") or [r["value"]])
    by_unit: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in pooled.values():
        by_unit[r["unit"]].append(r)
    if not by_unit:
        return []
    plt = pyplot()
    fig, axes = plt.subplots(1, len(by_unit), figsize=(4.5 * len(by_unit), 3.8), squeeze=False)
    for ax, (unit, recs) in zip(axes[0], sorted(by_unit.items()), strict=True):
        data = [r["samples"] for r in recs]
        names = [f"{label(r)}\n{params_text(r['params'])}".strip() for r in recs]
        box = ax.boxplot(data, patch_artist=True)
        for patch, r in zip(box["boxes"], recs, strict=True):
            projected = r["provenance"] == "projected"
            patch.set(facecolor="white" if projected else "#9ecae1",
                      hatch="//" if projected else None)
        ax.set_xticks(range(1, len(recs) + 1), names, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(unit)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{group.title}: samples per quantity")
    path = save(fig, out_dir / f"{group.kind}-{group.name}-samples.png")
    return [Figure(f"{group.title}: samples per quantity", path, commands(group.ok()))]


def accuracy_table(records: list[dict[str, Any]], machines: dict[str, str] | None = None
                   ) -> list[list[str]]:
    """Rows [strategy, params, perplexity, reference, change] with the full-attention
    reference at the same parameters minus the strategy's own (HGCA Table 1), from the same
    machine; `machines` (env id -> label) tags each strategy with its machine."""
    machines = machines or {}
    ppl = [r for r in records if r["metric"] == "perplexity" and r["status"] == "ok"]
    refs: dict[str | None, dict] = defaultdict(dict)
    for r in ppl:
        if r["name"] == REFERENCE:
            m = machines.get(r.get("env_id", ""))
            refs[m][tuple(sorted(r["params"].items(), key=str))] = r["value"]
    rows = []
    for r in sorted(ppl, key=lambda r: (r["name"] != REFERENCE, r["name"], str(r["params"]))):
        m = machines.get(r.get("env_id", ""))
        base = reference_value(refs[m], r["params"])
        change = "-" if base is None or r["name"] == REFERENCE else \
            f"{(r['value'] - base) / base:+.2%}"
        rows.append([r["name"] + (f" @ {m}" if m else ""), params_text(r["params"]),
                     f"{r['value']:.4g}",
                     "-" if base is None else f"{base:.4g}", change])
    return rows


def build(files: list[Path], fig_dir: Path) -> Report:
    """Load files, group records and draw every figure into fig_dir."""
    from kvbench.probes import PROBES

    envs: dict[str, dict[str, Any]] = {}
    records, warnings = [], []
    for f in files:
        rs = load(f)
        envs.update(rs.envs)
        records.extend(rs.records)
        warnings.extend(rs.warnings)
    by_key: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_key[(r["kind"], "" if r["kind"] == "run" else r["name"])].append(r)
    groups = [Group(k, n, recs) for (k, n), recs in by_key.items()]
    probes = set(PROBES.names())
    for g in groups:
        if g.kind == "run":
            g.figures = run_figures(g.records, fig_dir) + [
                Figure(title, path, commands(g.records))
                for title, path in budget_figures(g.records, fig_dir)]
        elif g.name in probes:
            paths = PROBES.get(g.name).plot(g.ok(), fig_dir)
            g.figures = [Figure(f"{g.title}: {p.stem}", p, commands(g.ok())) for p in paths]
        if not g.figures and g.kind != "run":
            g.figures = samples_figure(g, fig_dir)
    runs = [r for g in groups if g.kind == "run" for r in g.records]
    summary = summarize(envs, records, fig_dir)
    if summary.traces is not None:
        run_group = next(g for g in groups if g.kind == "run")
        run_group.figures.append(Figure("runs: per-layer work traces", summary.traces,
                                        commands(runs)))
    labels = {eid: machine_label(env) for eid, env in envs.items()}
    machines = labels if len(set(labels.values())) > 1 else {}
    return Report(files, envs, groups, warnings, accuracy_table(runs, machines), summary,
                  machines)


def env_summary(env: dict[str, Any]) -> dict[str, str]:
    """The env card: one line per aspect (CPU, NUMA, GPU, versions, source)."""
    cpu = env.get("cpu", {})
    nodes = env.get("numa_nodes", [])
    numa = ", ".join(f"node {n['id']}: {len(n['cpus'])} CPUs {format_bytes(n['mem_total_bytes'])}"
                     + (" memory-only" if n.get("memory_only") else "") for n in nodes)
    gpus = ", ".join(f"{g['name']} {g['memory_bytes'] / 1e9:.0f} GB" for g in env.get("gpus", []))
    node = env.get("node")  # a fleet machine (kvbench.fleet)
    return {
        **({"machine": f"{node['name']}, class {node['class']}"} if node else {}),
        "host": env.get("hostname", "?"),
        "CPU": f"{cpu.get('model', '?')} ({cpu.get('arch', '?')}), {cpu.get('logical_cpus', '?')} "
               f"logical CPUs, governor {cpu.get('governor') or '?'}",
        "memory": format_bytes(env.get("memory_bytes") or 0),
        "NUMA": numa or "unknown",
        "GPU": gpus or "none",
        "versions": ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items()),
        "source": f"{env.get('git_commit', '?')}{' (dirty)' if env.get('git_dirty') else ''}",
        "notes": "; ".join(env.get("notes", [])) or "-",
    }


def record_row(r: dict[str, Any], machine: str | None = None) -> list[str]:
    """[name (@ machine, when given), metric (projected labelled), params, value with spread,
    status]."""
    value = value_text(r["value"], r["unit"], r.get("stats")) if r["status"] == "ok" else "-"
    metric = label(r)
    if "cpu" in (r["params"].get("accel"), r["params"].get("device")):  # the role, not a GPU
        metric = metric.replace("gpu", "accel (cpu)")
    return [r["name"] + (f" @ {machine}" if machine else ""), metric, params_text(r["params"]),
            value,
            r["status"] + (f": {r['reason']}" if r.get("reason") else "")]


def markdown(rep: Report, fig_rel: Path | None) -> str:
    def table(head: list[str], rows: list[list[str]]) -> list[str]:
        return [*markdown_table(head, rows), ""]

    cols = ["name", "metric", "params", "value", "status"]
    lines = [f"# kvbench report: {', '.join(p.name for p in rep.files)}", ""]
    for env_id, env in rep.envs.items():
        lines += [f"**Environment {env_id}**", ""]
        lines += table(["", ""], [[k, v] for k, v in env_summary(env).items()])
    if rep.summary.by_machine:
        lines += ["## Machines side by side", ""]
        lines += table(rep.summary.by_machine[0], rep.summary.by_machine[1:])
    for title, head, rows in rep.summary.sweeps:
        lines += [f"## {title}", ""]
        lines += table(head, rows)
    lines += [f"> {n}" for n in rep.summary.notes]
    for g in rep.groups:
        lines += [f"## {g.title}", ""]
        if g.ok():
            lines += table(cols, [rep.row(r) for r in g.ok()])
        if g.not_ok():
            lines += ["Not measured:", ""]
            lines += table(cols, [rep.row(r) for r in g.not_ok()])
        for f in g.figures if fig_rel is not None else []:
            lines += [f"![{f.title}]({fig_rel / f.path.name})", ""]
        cmds = commands(g.records)
        lines += (["Commands:", "", "```sh", *cmds, "```", ""] if cmds else [])
    if rep.accuracy:
        lines += ["## Accuracy (perplexity, lower is better)", ""]
        lines += table(["strategy", "params", "perplexity", f"{REFERENCE} reference", "change"],
                       rep.accuracy)
    lines += [f"> warning: {w}" for w in rep.warnings]
    return "\n".join(lines) + "\n"


def table(rep: Report) -> None:
    from rich.table import Table

    from kvbench.console import console

    for env_id, env in rep.envs.items():
        console.print(f"[bold]environment {env_id}[/]")
        for k, v in env_summary(env).items():
            console.print(f"  [bold]{k}[/] {v}")
    if rep.summary.by_machine:
        t = Table(title="machines side by side (headline figures)")
        for col in rep.summary.by_machine[0]:
            t.add_column(col)
        for row in rep.summary.by_machine[1:]:
            t.add_row(*row)
        console.print(t)
    for title, head, rows in rep.summary.sweeps:
        t = Table(title=title)
        for col in head:
            t.add_column(col)
        for row in rows:
            t.add_row(*row)
        console.print(t)
    for note in rep.summary.notes:
        console.print(f"[yellow]note:[/] {note}")
    for g in rep.groups:
        t = Table(title=g.title)
        for col in ("name", "metric", "params", "value", "status"):
            t.add_column(col)
        for r in g.records:
            row = rep.row(r)
            style = {"waived": "yellow", "error": "red"}.get(r["status"]) or (
                "magenta" if r["provenance"] == "projected" else None)
            t.add_row(*row, style=style)
        console.print(t)
    if rep.accuracy:
        t = Table(title="accuracy (perplexity, lower is better)")
        for col in ("strategy", "params", "perplexity", f"{REFERENCE} reference", "change"):
            t.add_column(col)
        for row in rep.accuracy:
            t.add_row(*row)
        console.print(t)
    for w in rep.warnings:
        console.print(f"[yellow]warning:[/] {w}")
