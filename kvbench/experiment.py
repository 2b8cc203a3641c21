"""Declared experiments: a paper's experiment as one TOML file, run and rendered by kvbench.

`experiments/<name>.toml` declares what runs (suites), where the records it rests on are
committed, and its tables (kvbench.present.pivot): rows x columns of a metric with a filter,
a reference column (full attention), the tokens attended per step as an extra, and the
paper's values with their citation. `kvbench experiment run NAME [--resume]` runs the
suites (each into its own output, resumable) and folds their outputs into the committed
records file; `kvbench experiment render NAME` writes `results/<name>/table.md` from the
committed records only, so every cell traces to a record. As asv keeps benchmark code,
results and HTML apart, `results/<name>/` holds data and the rendered table, no code.

    [experiment]
    name = "page-sparse"            # results/<name>/ takes the outputs
    title = "..."
    setup = "Ours: ...; the paper: ..."   # model and hardware difference, stated once
    suites = ["suites/page-sparse-ppl.toml"]
    records = ["results/page-sparse/summary.jsonl.gz"]   # the first one is written by run
    keep_traces = ["trace.topk_recall"]                  # decode traces kept in it
    aliases = { budget = ["budget_tokens", "gpu_tokens"] }

    [[projection]]   # `kvbench project` over a sweep, rewritten whole by `run`
    source = "results/hgca-fig12/source.jsonl"   # runs with traces
    hardware = ["a6000-pcie4"]
    model = ["opt-6.7b", "opt-13b"]   # lists sweep; absent: each run's own shape
    batch = [1, 8]
    bookkeeping = ["measured", "none"]
    out = "results/hgca-fig12/projected.jsonl"

    [[table]]   # kvbench.present.pivot.Pivot's fields; [[table.extra]], [[table.paper]]

    [suite]     # optional: runs declared inline, a suite file's [suite], [[case]] and
    [[case]]    # [[ratio]] (kvbench.suite_spec); the declaration is then its first suite

Bad input (unknown suite, strategy, parameter or metric; two runs in one cell) is refused
with one line naming it, exit 2, before anything runs or is written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError, require
from kvbench.present.pivot import PER_RECORD, TOP_LEVEL, Extra, PaperTable, Pivot, Table
from kvbench.store import REPO_ROOT
from kvbench.suite_spec import INLINE, tomllib  # tomli on Python 3.10
from kvbench.timing import Stats

EXPERIMENTS = REPO_ROOT / "experiments"
_HEAD = {"name", "title", "setup", "suites", "records", "keep_traces", "aliases"}
_SWEPT = ("model", "batch", "prompt_len", "gen_len", "bookkeeping")


@dataclass(frozen=True)
class Projection:
    """`kvbench project SOURCE --hardware H...` at every point of the swept settings."""

    source: Path
    out: Path
    hardware: tuple[str, ...]
    sweep: dict[str, tuple[Any, ...]]  # _SWEPT names -> values
    dtype: str = "float16"
    memory: str = "pinned"

    def points(self) -> list[dict[str, Any]]:
        import itertools

        keys = list(self.sweep)
        return [dict(zip(keys, p, strict=True))
                for p in itertools.product(*(self.sweep[k] for k in keys))]
# parameters the run adds to every record beside its config's fields (runtime.run_params)
_RUN_LABELS = {"layers_total", "accel", "depth", "steps_completed", "prefix_chunk"}


@dataclass(frozen=True)
class Experiment:
    path: Path
    name: str
    title: str
    setup: str
    suites: tuple[Path, ...]
    records: tuple[Path, ...]
    keep_traces: tuple[str, ...]
    aliases: dict[str, tuple[str, ...]]
    tables: tuple[Pivot, ...]
    projections: tuple[Projection, ...] = ()

    @property
    def out(self) -> Path:
        return REPO_ROOT / "results" / self.name


def names() -> list[str]:
    """The declared experiments (experiments/*.toml)."""
    return sorted(p.stem for p in EXPERIMENTS.glob("*.toml"))


def _known_params() -> set[str]:
    from kvbench.probes import PROBES
    from kvbench.runtime.run import RunConfig
    from kvbench.strategies import STRATEGIES

    known = {f.name for f in dataclasses.fields(RunConfig)} | set(PER_RECORD) | _RUN_LABELS
    for cls in STRATEGIES.all():
        known |= {f.name for f in dataclasses.fields(cls.params)}
    for probe in PROBES.all():
        known |= {f.name for f in dataclasses.fields(probe.config)}
    return known | set(TOP_LEVEL)


def _pivot(raw: dict[str, Any], i: int, path: Path) -> Pivot:
    where = f"{path.name}: table {i + 1}"
    fields = {f.name for f in dataclasses.fields(Pivot)} - {"extras", "paper"}
    unknown = sorted(set(raw) - fields - {"extra", "paper"})
    require(not unknown, f"{where}: unknown key '{unknown[0] if unknown else ''}'")
    for key in ("title", "metric", "rows", "columns"):
        require(key in raw, f"{where}: '{key}' is required")
    try:
        extras = tuple(Extra(**e) for e in raw.get("extra", []))
        paper = tuple(PaperTable(p["citation"], tuple(p["columns"]),
                                 {k: tuple(v) for k, v in p["rows"].items()}, p.get("column"))
                      for p in raw.get("paper", []))
        kw = {k: v for k, v in raw.items() if k not in ("extra", "paper")}
        kw["rows"] = tuple(kw["rows"]) if isinstance(kw["rows"], list) else (kw["rows"],)
        kw["order"] = tuple(kw.get("order", ()))
        if isinstance(kw["metric"], list):
            kw["metric"] = tuple(kw["metric"])
        kw["ratios"] = tuple(tuple(r) for r in kw.get("ratios", ()))
        stats = {"value", *(f.name for f in dataclasses.fields(Stats))}
        for got in [kw.get("statistic", "value"), *(e.statistic for e in extras)]:
            require(got in stats, f"{where}: statistic '{got}': one of "
                    f"{', '.join(sorted(stats))}")
        return Pivot(**kw, extras=extras, paper=paper)
    except (TypeError, KeyError) as e:
        raise KvbenchError(f"{where}: {e}") from None


def _projection(raw: dict[str, Any], i: int, path: Path) -> Projection:
    where = f"{path.name}: projection {i + 1}"
    allowed = {"source", "out", "hardware", "dtype", "memory", *_SWEPT}
    unknown = sorted(set(raw) - allowed)
    require(not unknown, f"{where}: unknown key '{unknown[0] if unknown else ''}'")
    for key in ("source", "out", "hardware"):
        require(key in raw, f"{where}: '{key}' is required")
    source = REPO_ROOT / raw["source"]
    require(source.exists(), f"{where}: source '{raw['source']}' does not exist")
    sweep = {k: tuple(v) if isinstance(v, list) else (v,) for k, v in raw.items()
             if k in _SWEPT}
    for b in sweep.get("bookkeeping", ()):
        require(b in ("measured", "none"), f"{where}: bookkeeping '{b}': measured or none")
    hw = raw["hardware"]
    return Projection(source, REPO_ROOT / raw["out"], tuple(hw if isinstance(hw, list)
                                                            else [hw]), sweep,
                      raw.get("dtype", "float16"), raw.get("memory", "pinned"))


def load_experiment(name_or_path: str | Path) -> Experiment:
    """Parse and check a declaration: by name (experiments/NAME.toml) or path."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = EXPERIMENTS / f"{name_or_path}.toml"
        require(path.exists(), f"unknown experiment '{name_or_path}' (known: "
                f"{', '.join(names()) or 'none'})")
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise KvbenchError(f"cannot read experiment '{path}': {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise KvbenchError(f"{path}: not valid TOML: {e}") from None
    head = doc.get("experiment", {})
    unknown = sorted(set(head) - _HEAD) + sorted(set(doc) - {"experiment", "table",
                                                              "projection", *INLINE})
    require(not unknown, f"{path.name}: unknown key '{unknown[0] if unknown else ''}'")
    require("name" in head and head.get("records"), f"{path.name}: [experiment] needs a "
            "name and records")
    suites = tuple(REPO_ROOT / s for s in head.get("suites", []))
    for s in suites:
        require(s.exists(), f"{path.name}: unknown suite '{_rel(s)}'")
    if "case" in doc:  # runs declared inline: this file is a suite too
        suites = (path.resolve(), *suites)
    aliases = {k: tuple(v) for k, v in head.get("aliases", {}).items()}
    exp = Experiment(path, head["name"], head.get("title", head["name"]),
                     head.get("setup", ""), suites,
                     tuple(REPO_ROOT / r for r in head["records"]),
                     tuple(head.get("keep_traces", ())), aliases,
                     tuple(_pivot(t, i, path) for i, t in enumerate(doc.get("table", []))),
                     tuple(_projection(p, i, path)
                           for i, p in enumerate(doc.get("projection", []))))
    _check_names(exp)
    return exp


def _check_names(exp: Experiment) -> None:
    """Every strategy, probe and parameter a table names is one kvbench knows."""
    from kvbench.probes import PROBES
    from kvbench.strategies import STRATEGIES

    registered = set(STRATEGIES.names()) | set(PROBES.names())
    known = _known_params() | set(exp.aliases) | {"hardware", "bookkeeping", "gpus", "pnms"}
    for t in exp.tables:
        filters = [t.where, t.reference or {}]
        filters += [e.where for e in t.extras]
        for key in [*t.rows, t.columns, *(k for f in filters for k in f)]:
            require(key in known, f"{exp.path.name}: table '{t.title}': unknown parameter "
                    f"'{key}'")
        for f in filters:
            wanted = f.get("name", [])
            for name in wanted if isinstance(wanted, list) else [wanted]:
                require(name in registered, f"{exp.path.name}: table '{t.title}': unknown "
                        f"strategy or probe '{name}' (known: {', '.join(sorted(registered))})")


def load_records(exp: Experiment) -> list[dict[str, Any]]:
    from kvbench.store import load

    out = []
    for path in exp.records:
        if path.exists():
            out += load(path).records
    return out


def render(exp: Experiment) -> str:
    """table.md of the experiment from its committed records (every table checked first)."""
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
          + (", ".join(f"`{_rel(s)}`" for s in exp.suites) or "none") + ".",
          ""]
    if exp.setup:
        md += [exp.setup, ""]
    for t in tables:
        md += [*t.markdown(), ""]
    return "\n".join(md)


def project(proj: Projection) -> int:
    """Re-time the source's runs at every point; `proj.out` rewritten whole (projections
    are cheap). Every point is projected before anything is written."""
    from kvbench.envinfo import collect_env
    from kvbench.hwmodel.cli import projected, target_shape
    from kvbench.store import ResultWriter, load

    src = load(proj.source).records
    recs = []
    for point in proj.points():
        target = target_shape(point.get("model"), point.get("batch", 1),
                              point.get("prompt_len", 1920), point.get("gen_len", 128),
                              proj.dtype) if "model" in point else None
        recs += projected(src, _rel(proj.source), list(proj.hardware), [], proj.memory,
                          target, point.get("bookkeeping", "measured") == "measured")[0]
    proj.out.unlink(missing_ok=True)
    with ResultWriter(proj.out, collect_env()) as w:
        w.write_all(recs)
    return len(recs)


def _rel(path: Path) -> str:
    """`path` as records and messages name it: relative to the repository when inside."""
    return str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path)


def run(exp: Experiment, resume: bool, only: str | None = None) -> int:
    """Run every suite (resumable; `only`: the cases whose label or id matches the glob)
    and fold their outputs into the first records file: a record there is replaced when the
    outputs hold the same case of the same strategy version, and kept otherwise (other
    suites, cases not re-run, earlier versions). Returns the cases that ended in error."""
    import json

    from kvbench.store import read_lines, slim, unit_key
    from kvbench.suite import load_suite, run_suite, units

    # every suite checked before any runs; records name it as the repository does
    suites = [dataclasses.replace(load_suite(s), path=Path(_rel(s))) for s in exp.suites]
    require(only is None or any(units(s, only) for s in suites), f"--only '{only}' matches "
            f"no case of experiment '{exp.name}'")
    errors = 0
    for s in suites:
        out = REPO_ROOT / s.output  # absolute outputs stay as they are
        if only is None or units(s, only):
            errors += run_suite(s, out, resume=resume or out.exists(), only=only)

    def case(r: dict[str, Any]) -> tuple:
        return unit_key(r), r.get("name"), r.get("version")

    # every suite output here is folded in, also of suites `only` did not run this time
    outputs = [o for s in suites if (o := REPO_ROOT / s.output).exists()]
    if only is None:
        for proj in exp.projections:
            project(proj)
    fresh = {case(json.loads(ln)) for o in outputs for ln in read_lines(o)}
    target = exp.records[0]
    kept = [ln for ln in read_lines(target) if case(json.loads(ln)) not in fresh] \
        if target.exists() else []
    tmp = target.with_name(target.name + ".new.jsonl")
    tmp.write_text("".join(ln + "\n" for ln in kept))
    slim([tmp, *outputs], target, exp.keep_traces)
    tmp.unlink()
    return errors
