"""Declared experiments: a paper's experiment as one TOML file, run and rendered by kvbench.

`experiments/<name>.toml` declares what runs (suites), where the records it rests on are
committed, and its tables (kvbench.present.pivot): rows x columns of a metric with a filter,
a reference column (full attention), the tokens attended per step as an extra, and the
paper's values with their citation. `kvbench experiment run NAME [--resume] [--only
GLOB]` runs the suites (each into its own output: `--resume` continues it, `--only` measures
its matching cases again, otherwise an earlier output is refused) and folds their outputs
into the committed records file; `kvbench experiment render NAME` writes
`results/<name>/table.md` from the committed records only, so every cell traces to a
record. As asv keeps benchmark code, results and HTML apart, `results/<name>/` holds data
and the rendered table, no code.

    [experiment]
    name = "page-sparse"            # results/<name>/ takes the outputs
    title = "..."
    setup = "Ours: ...; the paper: ..."   # model and hardware difference, stated once
    suites = ["suites/page-sparse-ppl.toml"]
    records = ["results/page-sparse/summary.jsonl.gz"]   # the first one is written by run
    # a records file may label its records: { path = "...", params = { round = 1 } } adds
    # those parameters to each (files of one grid repeated in time, of one probe set)
    keep_traces = ["trace.topk_recall"]                  # decode traces kept in it
    aliases = { budget = ["budget_tokens", "gpu_tokens"] }
    # a probe suite run into `before` ahead of the suites and into `after` behind them
    probes = { suite = "suites/this-machine-probes.toml", before = "...", after = "..." }

    [[projection]]   # `kvbench project` over a sweep, rewritten whole by `run`
    source = "results/hgca-fig12/source.jsonl"   # runs with traces
    hardware = ["a6000-pcie4"]
    model = ["opt-6.7b", "opt-13b"]   # lists sweep; absent: each run's own shape
    batch = [1, 8]
    bookkeeping = ["measured", "none"]
    out = "results/hgca-fig12/projected.jsonl.gz"   # .gz: compressed after writing
    # hardware = "this" with probes = [files]: the profile built from those probe records

    [[derive]]   # kvbench.derive: records a function computes from the others (projected)
    function = "kvbench.prefix.roi:derived"
    args = { context = 256 }
    out = "results/prefix-cache/roi.jsonl"    # rewritten whole by `run`, after the suites

    [[table]]   # kvbench.present.pivot.Pivot's fields; [[table.extra]], [[table.paper]]
    [[control]] # kvbench.present.control: runs that must show no speed-up (render fails)

    [suite]     # optional: runs declared inline, a suite file's [suite], [[case]] and
    [[case]]    # [[ratio]] (kvbench.suite_spec); the declaration is then its first suite

Bad input (unknown suite, strategy, parameter or metric; two runs in one cell) is refused
with one line naming it, exit 2, before anything runs or is written.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kvbench.errors import require
from kvbench.experiment_spec import Experiment, load_experiment, names
from kvbench.experiment_spec import rel as _rel
from kvbench.present import control
from kvbench.present.table import Table
from kvbench.store import REPO_ROOT

__all__ = ["Experiment", "derive", "load_experiment", "load_records", "names", "project",
           "render", "report", "run"]


def load_records(exp: Experiment) -> list[dict[str, Any]]:
    from kvbench.store import load

    out = []
    for path in exp.records:
        if path.exists():
            label = exp.labels.get(path, {})
            out += [{**r, "params": {**r.get("params", {}), **label}} if label else r
                    for r in load(path).records]
    return out


def render(exp: Experiment) -> str:
    """table.md of the experiment from its committed records (every table checked first)."""
    return report(exp)[0]


def report(exp: Experiment) -> tuple[str, list[tuple[Any, list[Any]]]]:
    """table.md of the experiment and its controls' verdicts, from one read of its records."""
    records = load_records(exp)
    require(bool(records), f"experiment '{exp.name}': no records yet in "
            f"{', '.join(_rel(p) for p in exp.records)} (run "
            f"`kvbench experiment run {exp.name}`)")
    metrics = {r["metric"] for r in records}
    for t in exp.tables:
        main = [t.metric] if isinstance(t.metric, str) else list(t.metric)
        for m in [*main, *(e.metric for e in t.extras)]:
            require(m in metrics, f"{exp.path.name}: table '{t.title}': unknown metric "
                    f"'{m}' (none in the records)")
    tables = [Table(t, records, exp.aliases) for t in exp.tables]
    md = [f"# {exp.title}", "",
          f"Rendered by `kvbench experiment render {exp.name}` from {_rel(exp.path)} and the "
          "records "
          "in " + ", ".join(f"`{_rel(p)}`" for p in exp.records if p.exists()) + "; runs: "
          + (", ".join(f"`{_rel(s)}`" for s in exp.suites) or "none")
          + (f", with `{_rel(exp.probes[0])}` run before and after them"
             if exp.probes else "") + ".",
          ""]
    if exp.setup:
        md += [exp.setup, ""]
    for t in tables:
        md += [*t.markdown(), ""]
    verdicts = [(c, control.verdicts(c, records, exp.aliases)) for c in exp.controls]
    if verdicts:
        md += ["## Negative controls", ""]
    for c, found in verdicts:
        md += [*control.markdown(c, found), ""]
    return "\n".join(md), verdicts


def project(exp: Experiment) -> int:
    """Write every projection's records, each `out` rewritten whole (they are cheap);
    every point of every block is computed before anything is written."""
    from kvbench.envinfo import collect_env
    from kvbench.hwmodel.sweep import records
    from kvbench.schema import Record
    from kvbench.store import ResultWriter, open_text

    outs: dict[Path, list[Record]] = {}
    for proj in exp.projections:
        for f in [proj.source, *proj.probes]:
            require(f.exists(), f"experiment '{exp.name}': projection input '{_rel(f)}' "
                    "does not exist (run the suites first)")
        outs.setdefault(proj.out, []).extend(records(proj, _rel(proj.source)))
    for out, recs in outs.items():
        # the writer appends plain lines: an `out` ending in .gz is compressed from them
        plain = out.with_name(out.name + ".new.jsonl") if out.suffix == ".gz" else out
        plain.unlink(missing_ok=True)
        with ResultWriter(plain, collect_env()) as w:
            w.write_all(recs)
        if plain != out:
            with open_text(out, "w") as f:
                f.write(plain.read_text(encoding="utf-8"))
            plain.unlink()
    return sum(map(len, outs.values()))


def _probes(suite: Path, out: Path) -> int:
    """The probe suite run afresh into `out` (the machine's speed at that moment)."""
    from kvbench.suite import load_suite, run_suite

    out.unlink(missing_ok=True)
    return run_suite(dataclasses.replace(load_suite(suite), path=Path(_rel(suite))), out)


def _forget(out: Path, keys: set[str]) -> None:
    """Drop the records of suite units `keys` from the suite output `out` (environment lines
    and other units stay), so that a run of those units appends them afresh."""
    import json

    from kvbench.store import read_lines, unit_key

    tmp = out.with_name(out.name + ".forget")
    tmp.write_text("".join(ln + "\n" for ln in read_lines(out)
                           if unit_key(json.loads(ln)) not in keys))
    tmp.replace(out)


def run(exp: Experiment, resume: bool, only: str | None = None) -> int:
    """Run every suite and fold their outputs into the first records file: a record there
    is replaced when the outputs hold the same case of the same strategy version, and kept
    otherwise (other suites, cases not re-run, earlier versions); then the derivations.
    `resume` continues the suites' outputs (recorded cases skipped); without it an earlier
    output is refused, except with `only` (the cases whose label or id matches the glob),
    whose cases are measured again: their old records leave the output first. Returns the
    cases that ended in error."""
    import json

    from kvbench.store import read_lines, slim, unit_key
    from kvbench.suite import load_suite, run_suite, units

    # every suite checked before any runs; records name it as the repository does
    suites = [dataclasses.replace(load_suite(s), path=Path(_rel(s))) for s in exp.suites]
    require(only is None or any(units(s, only) for s in suites), f"--only '{only}' matches "
            f"no case of experiment '{exp.name}'")
    # absolute outputs stay as they are
    runs = [(s, REPO_ROOT / s.output) for s in suites if only is None or units(s, only)]
    held = [out for _, out in runs if out.exists() and out.stat().st_size]
    require(resume or only is not None or not held, f"'{_rel(held[0]) if held else ''}' "
            "holds an earlier run: pass --resume to continue it, or move it away to "
            "measure again")
    errors = 0
    if exp.probes and only is None and not (resume and exp.probes[1].exists()):
        errors += _probes(exp.probes[0], exp.probes[1])
    for s, out in runs:
        if only is not None and not resume and out in held:  # measured again
            _forget(out, {u.key for u in units(s, only)})
        errors += run_suite(s, out, resume=out.exists(), only=only)
    if exp.probes and only is None:
        errors += _probes(exp.probes[0], exp.probes[2])

    def case(r: dict[str, Any]) -> tuple:
        return unit_key(r), r.get("name"), r.get("version")

    # every suite output here is folded in, also of suites `only` did not run this time
    outputs = [o for s in suites if (o := REPO_ROOT / s.output).exists()]
    if only is None:
        project(exp)
    new = [json.loads(ln) for o in outputs for ln in read_lines(o)]
    fresh = {case(r) for r in new if r.get("kind") != "env"}
    envs = {r["env_id"] for r in new if r.get("kind") == "env"}

    def stays(r: dict[str, Any]) -> bool:
        """An old line not replaced: an env line the outputs do not repeat (the records
        kept still name it), a record of a case the outputs do not hold."""
        return r["env_id"] not in envs if r.get("kind") == "env" else case(r) not in fresh

    target = exp.records[0]
    kept = [ln for ln in read_lines(target) if stays(json.loads(ln))] \
        if target.exists() else []
    tmp = target.with_name(target.name + ".new.jsonl")
    tmp.write_text("".join(ln + "\n" for ln in kept))
    slim([tmp, *outputs], target, exp.keep_traces)
    tmp.unlink()
    if only is None:  # after the fold: they read the records just folded in
        derive(exp)
    return errors


def derive(exp: Experiment) -> None:
    """Rewrite every derivation's records from the experiment's other records."""
    from kvbench.store import load

    for d in exp.derivations:
        d.write([r for p in exp.records if p != d.out and p.exists() for r in load(p).records])
