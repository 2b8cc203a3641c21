"""An experiment's declaration (experiments/NAME.toml) parsed and checked: its runs,
records, tables, projections and derivations, every name in them one kvbench knows
(kvbench.experiment runs and renders it; the format is in its docstring).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.derive import Derivation
from kvbench.errors import KvbenchError, require
from kvbench.hwmodel.sweep import SWEPT, Projection
from kvbench.present.control import Control
from kvbench.present.pivot import COMPUTED, PER_RECORD, TOP_LEVEL, Extra, PaperTable, Pivot
from kvbench.store import REPO_ROOT
from kvbench.suite_spec import EXPERIMENT, INLINE, tomllib  # tomli on Python 3.10
from kvbench.timing import Stats

EXPERIMENTS = REPO_ROOT / "experiments"
_HEAD = {"name", "title", "setup", "suites", "records", "keep_traces", "aliases", "probes"}


# parameters the run adds to every record beside its config's fields (runtime.run_params;
# a prefix-cache run labels its requests, kvbench.prefix.turns)
_RUN_LABELS = {"layers_total", "accel", "depth", "steps_completed", "prefix_chunk", "turn",
               "path", "prefix_tokens", "request_tokens"}


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
    labels: dict[Path, dict[str, Any]] = dataclasses.field(default_factory=dict)  # per file
    probes: tuple[Path, Path, Path] | None = None  # probe suite, before, after
    derivations: tuple[Derivation, ...] = ()
    controls: tuple[Control, ...] = ()

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
        known |= {f.name for f in dataclasses.fields(probe.config)} | set(probe.record_params)
    return known | set(TOP_LEVEL) | set(COMPUTED)


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
        for key in ("columns", "reference_by"):
            if isinstance(kw.get(key), list):
                kw[key] = tuple(kw[key])
        if isinstance(kw["metric"], list):
            kw["metric"] = tuple(kw["metric"])
        kw["ratios"] = tuple(tuple(r) for r in kw.get("ratios", ()))
        stats = {"value", *(f.name for f in dataclasses.fields(Stats))}
        kw["spread_stats"] = tuple(kw.get("spread_stats", ("p10", "p90")))
        require(len(kw["spread_stats"]) == 2, f"{where}: spread_stats: two statistics")
        for got in [kw.get("statistic", "value"), *(e.statistic for e in extras),
                    *kw["spread_stats"]]:
            require(got in stats, f"{where}: statistic '{got}': one of "
                    f"{', '.join(sorted(stats))}")
        require(not kw.get("paired") or (kw.get("median_over") and kw.get("reference")),
                f"{where}: paired: needs median_over and a reference")
        return Pivot(**kw, extras=extras, paper=paper)
    except (TypeError, KeyError) as e:
        raise KvbenchError(f"{where}: {e}") from None


def _control(raw: dict[str, Any], i: int, path: Path) -> Control:
    where = f"{path.name}: control {i + 1}"
    unknown = sorted(set(raw) - {f.name for f in dataclasses.fields(Control)})
    require(not unknown, f"{where}: unknown key '{unknown[0] if unknown else ''}'")
    for key in ("title", "where", "reference"):
        require(key in raw, f"{where}: '{key}' is required")
    tolerance = raw.get("tolerance", 0.10)
    require(isinstance(tolerance, int | float) and 0 <= tolerance < 1,
            f"{where}: tolerance {tolerance!r}: a share from 0 to 1, e.g. 0.1")
    return Control(**{**raw, "match": tuple(raw.get("match", ()))})


def _projection(raw: dict[str, Any], i: int, path: Path, produced: set[Path]) -> Projection:
    """One [[projection]]; its source and probe files exist or are what `run` writes first
    (`produced`: the suites' outputs, the probes before and after)."""
    where = f"{path.name}: projection {i + 1}"
    extra = {f.name for f in dataclasses.fields(Projection)} - {"source", "out", "hardware",
                                                                   "sweep"}
    unknown = sorted(set(raw) - {"source", "out", "hardware", *SWEPT, *extra})
    require(not unknown, f"{where}: unknown key '{unknown[0] if unknown else ''}'")
    for key in ("source", "out", "hardware"):
        require(key in raw, f"{where}: '{key}' is required")
    source, probes = REPO_ROOT / raw["source"], [REPO_ROOT / f for f in raw.get("probes", [])]
    for f in [source, *probes]:
        require(f.exists() or f in produced, f"{where}: '{rel(f)}' does not exist and no "
                "suite of the experiment writes it")
    sweep = {k: tuple(v) if isinstance(v, list) else (v,) for k, v in raw.items()
             if k in SWEPT}
    for b in sweep.get("bookkeeping", ()):
        require(b in ("measured", "none"), f"{where}: bookkeeping '{b}': measured or none")
    keep = raw.get("source_where", {})
    require(isinstance(keep, dict) and all(isinstance(v, str | int | float | bool)
                                           for v in keep.values()),
            f"{where}: source_where: a table of parameters and values, e.g. "
            "{ budget_tokens = 256 }")
    require(sweep.get("batch") != ("max",) or raw.get("budget_ratio", 0) > 0,
            f"{where}: batch \"max\" needs budget_ratio")
    hw = tuple(raw["hardware"] if isinstance(raw["hardware"], list) else [raw["hardware"]])
    require(not probes or "this" in hw, f"{where}: probes: only hardware 'this' is built "
            "from probe files")
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in extra}
    try:
        return Projection(source, REPO_ROOT / raw["out"], hw, sweep, **{**kw, "probes": tuple(
            probes)})
    except TypeError as e:
        raise KvbenchError(f"{where}: {e}") from None


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
    unknown = sorted(set(head) - _HEAD) + sorted(set(doc) - {*EXPERIMENT, *INLINE})
    require(not unknown, f"{path.name}: unknown key '{unknown[0] if unknown else ''}'")
    require("name" in head and head.get("records"), f"{path.name}: [experiment] needs a "
            "name and records")
    suites = tuple(REPO_ROOT / s for s in head.get("suites", []))
    probes = head.get("probes")
    if probes is not None:
        require(isinstance(probes, dict) and set(probes) == {"suite", "before", "after"},
                f"{path.name}: probes needs suite, before and after")
        probes = tuple(REPO_ROOT / probes[k] for k in ("suite", "before", "after"))
    for s in [*suites, *probes[:1]] if probes else suites:
        require(s.exists(), f"{path.name}: unknown suite '{rel(s)}'")
    if "case" in doc:  # runs declared inline: this file is a suite too
        suites = (path.resolve(), *suites)
    aliases = {k: tuple(v) for k, v in head.get("aliases", {}).items()}
    records = [r if isinstance(r, dict) else {"path": r} for r in head["records"]]
    require(all(set(r) <= {"path", "params"} and "path" in r for r in records),
            f"{path.name}: a records entry is a path or {{ path, params }}")
    from kvbench.suite_spec import load_suite

    produced = {REPO_ROOT / load_suite(s).output for s in suites} | set(probes[1:] if probes
                                                                       else ())
    exp = Experiment(path, head["name"], head.get("title", head["name"]),
                     head.get("setup", ""), suites,
                     tuple(REPO_ROOT / r["path"] for r in records),
                     tuple(head.get("keep_traces", ())), aliases,
                     tuple(_pivot(t, i, path) for i, t in enumerate(doc.get("table", []))),
                     tuple(_projection({**doc.get("projection_defaults", {}), **p}, i, path,
                                       produced)
                           for i, p in enumerate(doc.get("projection", []))),
                     labels={REPO_ROOT / r["path"]: r["params"] for r in records
                             if "params" in r},
                     probes=probes,
                     derivations=tuple(Derivation.parse(d, REPO_ROOT, f"{path.name}: derive "
                                                        f"{i + 1}")
                                       for i, d in enumerate(doc.get("derive", []))),
                     controls=tuple(_control(c, i, path)
                                    for i, c in enumerate(doc.get("control", []))))
    _check_names(exp)
    return exp


def _check_names(exp: Experiment) -> None:
    """Every strategy, probe and parameter a table names is one kvbench knows."""
    from kvbench.hwmodel.sweep import RECORD_PARAMS
    from kvbench.probes import PROBES
    from kvbench.strategies import STRATEGIES

    registered = set(STRATEGIES.names()) | set(PROBES.names()) | {"plan"}  # kvbench.plan
    # besides runs' parameters: what projections, derivations and record labels add
    known = _known_params() | set(exp.aliases) | set(RECORD_PARAMS) | {
        k for p in exp.projections for k in p.tag}
    known |= {k for label in exp.labels.values() for k in label}
    known |= {k for d in exp.derivations for k in d.params()}
    for c in exp.controls:
        for key in [*c.match, *c.where, *c.reference]:
            require(key in known, f"{exp.path.name}: control '{c.title}': unknown parameter "
                    f"'{key}'")
    for t in exp.tables:
        filters = [t.where, t.reference or {}]
        filters += [e.where for e in t.extras]
        cols = (t.columns,) if isinstance(t.columns, str) else t.columns
        for key in [*t.rows, *cols, *(t.reference_by or ()), *(k for f in filters for k in f)]:
            require(key in known, f"{exp.path.name}: table '{t.title}': unknown parameter "
                    f"'{key}'")
        for f in filters:
            wanted = f.get("name", [])
            for name in wanted if isinstance(wanted, list) else [wanted]:
                require(name in registered, f"{exp.path.name}: table '{t.title}': unknown "
                        f"strategy or probe '{name}' (known: {', '.join(sorted(registered))})")


def rel(path: Path) -> str:
    """`path` as records and messages name it: relative to the repository when inside."""
    return str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path)
