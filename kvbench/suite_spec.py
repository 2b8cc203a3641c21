"""Suite files: parse the TOML, check every case before anything runs, build configs.

All problems (unknown keys, unknown probe or strategy names, values of the wrong type,
sizes that do not parse) are collected with their line and raised as one KvbenchError.
A probe case builds its `config` dataclass from `params` by field name; a strategy case
is checked against the runtime's RunConfig and the strategy's `params` dataclass, and run
as the `kvbench run NAME` command in a child process.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.schema import Record
from kvbench.units import parse_fraction, parse_size, parse_sizes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

_SUITE_KEYS = {"name", "description", "output", "repetitions", "guard", "threshold", "machines",
               "order"}
_CASE_KEYS = {"probe", "strategy", "id", "params", "sweep", "repetitions", "requires", "note",
              "exclusive", "resources"}
_ACCURACY_MODES = ("eval", "passkey")  # strategy modes whose headline is not a speed
_RATIO_KEYS = {"name", "numerator", "denominator", "direction", "match", "where"}
_REQUIRES = {"gpu"}
INLINE = ("suite", "case", "ratio")  # a suite's tables, also inline in an experiment
# an experiment's own tables (kvbench.experiment), beside which a suite's may be inline
EXPERIMENT = ("experiment", "table", "projection", "projection_defaults", "derive", "control")


@dataclass
class Case:
    """One `[[case]]`: what to run, its explicit parameters and sweep, how often, where."""

    kind: str  # "probe" or "run"
    name: str
    params: dict[str, Any]
    sweep: dict[str, list[Any]]
    repetitions: int
    requires: str | None
    id: str | None
    version: str
    build: Callable[[dict[str, Any]], Any] = field(repr=False)
    records: Callable[[Any], Iterator[Record]] = field(repr=False)
    exclusive: bool = True  # runs alone on its machine (`--jobs`, fleet nodes)
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources


@dataclass(frozen=True)
class RatioSpec:
    """A `[[ratio]]`: numerator and denominator are 'name.metric' of records in the run."""

    name: str
    numerator: str
    denominator: str
    direction: str = "higher"
    match: tuple[str, ...] = ()
    where: tuple[tuple[str, Any], ...] = ()  # (parameter, value) a record must have


@dataclass
class Suite:
    path: Path
    name: str
    output: Path
    cases: list[Case]
    ratios: list[RatioSpec]
    guard: dict[str, float]  # metric glob -> threshold
    threshold: float
    description: str = ""
    machines: list[str] = field(default_factory=list)  # fleet: machine classes to fan out to
    text: str = ""  # the TOML, shipped to `--jobs` workers and fleet nodes
    order: str = "case"  # "round": every case's repetition r before any case's r + 1


class _Lines:
    """Line numbers of tables and keys in the TOML text (tomllib gives none)."""

    def __init__(self, text: str) -> None:
        self.lines = text.splitlines()
        self.heads = [(i, m.group(1)) for i, ln in enumerate(self.lines)
                      if (m := re.match(r"\s*\[\[?\s*([\w.-]+)\s*\]\]?", ln))]

    def table(self, name: str, index: int = 0) -> tuple[int, int]:
        """0-based [start, end) of the index-th `[[name]]` (or `[name]`) with its subtables."""
        starts = [i for i, h in self.heads if h == name]
        if index >= len(starts):
            return 0, len(self.lines)
        start = starts[index]
        end = next((i for i, h in self.heads if i > start and h != name
                    and not h.startswith(name + ".")), len(self.lines))
        end = min([end] + [i for i in starts if i > start])
        return start, end

    def key(self, table: str, index: int, key: str, within: str | None = None) -> int:
        """1-based line of `key =` inside that table (after the line of `within =` or
        `[table.within]` when given), else the table's header line."""
        start, end = self.table(table, index)
        if within is not None:
            start = self.key(table, index, within) - 1
        pat = re.compile(rf"(^|[\s{{,.\[]){re.escape(key)}\s*(=|\])")
        for i in range(start, end):
            if pat.search(self.lines[i].split("#", 1)[0]):
                return i + 1
        return start + 1


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Check a TOML value against a config field type; sizes may be written '4K'."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, name)
            except (ValueError, KvbenchError) as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"bad value {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise ValueError(f"{value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (tuple, list):
        elem = args[0] if args else Any
        if isinstance(value, str) and elem is int:
            return tuple(parse_sizes(value))
        if not isinstance(value, list):
            raise ValueError(f"expected a list, got {value!r}")
        return tuple(_coerce(v, elem, name) for v in value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
    elif tp is int:
        if isinstance(value, str):
            try:
                return parse_size(value)
            except KvbenchError:
                raise ValueError(f"expected an integer or a size like 4K, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {value!r}")
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected a number, got {value!r}")
        return float(value)
    elif tp is str:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
        if "size" in name:
            parse_sizes(value)
    elif tp is Path:
        if not isinstance(value, str):
            raise ValueError(f"expected a path string, got {value!r}")
        return Path(value)
    return value


def _fields(config: type) -> dict[str, Any]:
    """Field types of the options of a config dataclass (what a case's params may set)."""
    from kvbench.options import fields

    hints = typing.get_type_hints(config)
    return {f.name: hints[f.name] for f in fields(config)}


def _strategy_options(cls: type) -> dict[str, Any] | None:
    """Field types of a strategy case: the shared RunConfig and the strategy's `params`
    (None when this kvbench has no model runtime)."""
    try:
        from kvbench.runtime.run import RunConfig
    except ImportError:
        return None
    return {**_fields(RunConfig), **_fields(cls.params)}


def _target(case: dict[str, Any]) -> tuple[str, str, type, Any]:
    """(kind, name, class, config class or None) of a case; raises KvbenchError."""
    from kvbench.probes import PROBES
    from kvbench.strategies import STRATEGIES

    if "probe" in case:
        cls = PROBES.get(str(case["probe"]))
        return "probe", cls.name, cls, cls.config
    cls = STRATEGIES.get(str(case["strategy"]))
    return "run", cls.name, cls, cls.params


def _run_strategy(name: str, params: dict[str, Any]) -> Iterator[Record]:
    """Run `kvbench run NAME` with these options into a scratch file and yield its records.

    The run has a session of its own, so an interrupt reaches it once, from here: on
    Ctrl-C or SIGTERM it is sent the same signal, stops after its current decode step and
    stores the steps it finished (marked partial), which are yielded before the interrupt
    goes on."""
    import signal
    import subprocess
    import tempfile

    from kvbench.options import to_argv

    with tempfile.TemporaryDirectory() as tmp:
        out, log = Path(tmp) / "run.jsonl", Path(tmp) / "stderr.txt"
        args = [sys.executable, "-m", "kvbench.cli", "run", name, "--out", str(out),
                *to_argv(params)]
        with log.open("w") as err:
            proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)
        try:
            code = proc.wait()
        except BaseException as e:
            _stop(proc, signal.SIGINT if isinstance(e, KeyboardInterrupt) else signal.SIGTERM)
            yield from _stored(out)
            raise
        if code != 0 or not out.exists():
            tail = (log.read_text().strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"kvbench run {name} exited {code}: {tail}")
        yield from _stored(out)


def _stop(proc: Any, sig: int) -> None:
    """Send a running child `sig` and wait for it to store its records; killed when this
    wait is interrupted in turn."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait()
    except BaseException:
        proc.kill()
        raise


def _stored(path: Path) -> Iterator[Record]:
    """The records of a run's result file (none when it wrote none)."""
    from kvbench.store import load

    if not path.exists():
        return
    keep = {f.name for f in dataclasses.fields(Record)}
    for r in load(path).records:
        yield Record(**{k: v for k, v in r.items() if k in keep})


def _case(raw: dict[str, Any], i: int, lines: _Lines, default_reps: int,
          problems: list[tuple[int, str]]) -> Case | None:
    def bad(key: str, msg: str, within: str | None = None) -> None:
        problems.append((lines.key("case", i, key, within), msg))

    for key in sorted(set(raw) - _CASE_KEYS):
        bad(key, f"unknown key '{key}' in case (known: {', '.join(sorted(_CASE_KEYS))})")
    if ("probe" in raw) == ("strategy" in raw):
        problems.append((lines.table("case", i)[0] + 1, "a case names exactly one of probe, "
                         "strategy"))
        return None
    try:
        kind, name, cls, config = _target(raw)
    except KvbenchError as e:
        bad("probe" if "probe" in raw else "strategy", str(e))
        return None
    types_ = _strategy_options(cls) if kind == "run" else _fields(config)
    if types_ is None:
        bad("strategy", "strategy cases need the model runtime (kvbench.runtime), not here")
        return None
    params, sweep = raw.get("params", {}), raw.get("sweep", {})
    reps, requires = raw.get("repetitions", default_reps), raw.get("requires")
    if not isinstance(params, dict) or not isinstance(sweep, dict):
        bad("params", "params and sweep must be tables")
        return None
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        bad("repetitions", f"repetitions must be a positive integer, got {reps!r}")
    if requires is not None and requires not in _REQUIRES:
        bad("requires", f"requires must be one of {', '.join(sorted(_REQUIRES))}")
    resources = raw.get("resources", {})
    if not isinstance(resources, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
            for v in resources.values()):
        bad("resources", "resources must be a table of resource name = positive amount")
        resources = {}
    # speed is measured alone by default: every probe, every strategy case outside the
    # accuracy modes; a case says `exclusive = false` to share its machine under --jobs
    exclusive = raw.get("exclusive", kind == "probe" or
                        raw.get("params", {}).get("mode") not in _ACCURACY_MODES)
    if not isinstance(exclusive, bool):
        bad("exclusive", f"exclusive must be true or false, got {exclusive!r}")
    entries = [("params", k, [v]) for k, v in params.items()]
    entries += [("sweep", k, v) for k, v in sweep.items()]
    typed = len(problems)
    for within, key, values in entries:
        if key not in types_:
            bad(key, f"{name} has no parameter '{key}' (known: {', '.join(types_) or 'none'})",
                within)
            continue
        if not isinstance(values, list) or not values:
            bad(key, f"sweep '{key}' must be a non-empty list", within)
            continue
        for v in values:
            try:
                _coerce(v, types_[key], key)
            except (ValueError, KvbenchError) as e:
                bad(key, f"{name}.{key}: {e}", within)

    def build(p: dict[str, Any]) -> Any:
        """The config of a point (its dataclasses check their values); a strategy case
        runs as a command line, so its config is the checked parameters themselves."""
        values = {k: _coerce(v, types_[k], k) for k, v in p.items()}
        if kind == "probe":
            return config(**values)
        from kvbench.runtime.run import RunConfig

        shared = set(_fields(RunConfig))
        RunConfig(**{k: v for k, v in values.items() if k in shared})
        config(**{k: v for k, v in values.items() if k not in shared})
        return p

    if len(problems) == typed:  # every value typed: build every point's config up front
        for point in itertools.product(*sweep.values()):
            try:
                build({**params, **dict(zip(sweep, point, strict=True))})
            except (KvbenchError, ValueError, TypeError) as e:
                problems.append((lines.table("case", i)[0] + 1, f"{name}: {e}"))
                break

    def records(cfg: Any) -> Iterator[Record]:
        from kvbench.probes import measure

        return _run_strategy(name, cfg) if kind == "run" else measure(cls(), cfg)

    return Case(kind, name, dict(params), {k: list(v) for k, v in sweep.items()},
                reps if isinstance(reps, int) else 1, requires, raw.get("id"),
                getattr(cls, "version", "1"), build, records, exclusive is not False,
                {str(k): float(v) for k, v in resources.items()})


def load_suite(path: Path | str, text: str | None = None) -> Suite:
    """Parse and validate a suite file (or its `text`, as a worker receives it); every
    problem is reported at once (KvbenchError)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8") if text is None else text
    except OSError as e:
        from kvbench.paths import shown

        raise KvbenchError(f"cannot read suite '{shown(path)}': {e.strerror}") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise KvbenchError(f"{path}: not valid TOML: {e}") from None
    lines, problems = _Lines(text), []
    for key in sorted(set(doc) - {*INLINE, *(EXPERIMENT if "experiment" in doc else ())}):
        problems.append((lines.key("", 0, key), f"unknown top-level key '{key}'"))
    head = doc.get("suite", {})
    for key in sorted(set(head) - _SUITE_KEYS):
        problems.append((lines.key("suite", 0, key), f"unknown key '{key}' in [suite]"))
    reps = head.get("repetitions", 1)
    threshold = 0.05
    try:
        threshold = parse_fraction(str(head.get("threshold", "5%")), "threshold")
    except KvbenchError as e:
        problems.append((lines.key("suite", 0, "threshold"), str(e)))
    cases = [_case(c, i, lines, reps if isinstance(reps, int) else 1, problems)
             for i, c in enumerate(doc.get("case", []))]
    ratios = []
    for i, r in enumerate(doc.get("ratio", [])):
        unknown = sorted(set(r) - _RATIO_KEYS)
        missing = [k for k in ("name", "numerator", "denominator") if k not in r]
        for key in unknown:
            problems.append((lines.key("ratio", i, key), f"unknown key '{key}' in ratio"))
        bad_where = not isinstance(r.get("where", {}), dict)
        if bad_where:
            problems.append((lines.key("ratio", i, "where"), "a ratio's where is a table of "
                             "parameter values, e.g. where = { prompt_len = 2048 }"))
        if missing or r.get("direction", "higher") not in ("higher", "lower"):
            problems.append((lines.table("ratio", i)[0] + 1, "a ratio needs name, numerator, "
                             "denominator and a direction of higher or lower"))
        elif not unknown and not bad_where:
            ratios.append(RatioSpec(r["name"], r["numerator"], r["denominator"],
                                    r.get("direction", "higher"), tuple(r.get("match", ())),
                                    tuple(sorted(r.get("where", {}).items()))))
    guard = head.get("guard", [])
    if isinstance(guard, list):
        guard = dict.fromkeys(guard, str(head.get("threshold", "5%")))
    guards = {}
    for glob, limit in guard.items() if isinstance(guard, dict) else []:
        try:
            guards[glob] = parse_fraction(str(limit), "threshold")
        except KvbenchError as e:
            problems.append((lines.key("suite.guard", 0, glob), f"guard '{glob}': {e}"))
    machines = head.get("machines", [])
    if not isinstance(machines, list) or not all(isinstance(m, str) for m in machines):
        problems.append((lines.key("suite", 0, "machines"), "machines must be a list of "
                         "machine class names"))
        machines = []
    if head.get("order", "case") not in ("case", "round"):
        problems.append((lines.key("suite", 0, "order"), "order must be 'case' (a case's "
                         "repetitions back to back) or 'round' (interleaved)"))
    if not doc.get("case"):
        problems.append((1, "the suite has no [[case]]"))
    if len(problems) == 1:
        raise KvbenchError(f"{path}:{problems[0][0]}: {problems[0][1]} (nothing was run)")
    if problems:
        detail = "\n".join(f"  {path}:{line}: {msg}" for line, msg in sorted(problems))
        raise KvbenchError(f"{path}: {len(problems)} problem(s), nothing was run\n{detail}")
    return Suite(path, head.get("name", path.stem), Path(head.get("output",
                 f"results/{path.stem}.jsonl")), [c for c in cases if c], ratios,
                 guards, threshold, head.get("description", ""), machines, text,
                 head.get("order", "case"))
