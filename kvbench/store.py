"""The one result store: append-only JSON Lines, flushed record by record.

An interrupted run leaves every finished record readable; the loader reports a torn last
line and keeps the rest. The environment is stored once per file (kind "env") and every
record points at it through env_id.
"""

from __future__ import annotations

import datetime as dt
import gzip
import io
import json
import os
import shlex
import stat
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench import __version__, paths
from kvbench.errors import KvbenchError
from kvbench.schema import KNOWN_SCHEMA_VERSIONS, SCHEMA_VERSION, Record, now_iso

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = paths.RESULTS_DIR


def git_state(root: Path = REPO_ROOT) -> tuple[str, bool]:
    """(commit, dirty) of the source tree kvbench runs from; ('unknown', False) outside git."""
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], check=True, capture_output=True,
                               text=True, timeout=10).stdout.strip() != ""
        return commit, dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown", False


def default_out_path(name: str) -> Path:
    """A new file under results/ named after what is measured and when."""
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = RESULTS_DIR / f"{name}-{stamp}.jsonl"
    n = 1
    while path.exists():
        n += 1
        path = RESULTS_DIR / f"{name}-{stamp}-{n}.jsonl"
    return path


def _cut_torn_tail(path: Path) -> None:
    """Before appending: cut the torn last line an interrupted write left (bytes after the
    last newline; `load` skips such a line only while it is last, and it holds no whole
    record), so the next record starts a line of its own."""
    if not path.is_file():
        return
    with path.open("rb+") as f:
        end = f.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:
            step = min(pos, 1 << 16)
            f.seek(pos - step)
            nl = f.read(step).rfind(b"\n")
            if nl >= 0:
                pos = pos - step + nl + 1
                break
            pos -= step
        if pos < end:
            f.truncate(pos)


class ResultWriter:
    """Appends records to one JSONL file, writing the environment line first if new to it.

    Nothing touches the file until the first record: a command rejected for bad input
    (its probe raises before measuring anything) leaves no file behind.
    """

    def __init__(self, path: Path, env: dict[str, Any], command: str | None = None) -> None:
        self.path = Path(path)
        self.env = env
        self.env_id: str = env["env_id"]
        self.command = command if command is not None else shlex.join(["kvbench", *sys.argv[1:]])
        self.commit, self.dirty = git_state()
        self.count = 0
        self._fh: Any = None

    def _open(self) -> Any:
        """Open the file for appending on first use, writing the env line if it is new."""
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _cut_torn_tail(self.path)
            known = load(self.path).envs if self.path.exists() and self.path.stat().st_size \
                else {}
            self._fh = self.path.open("a", encoding="utf-8")
            if self.env_id not in known:
                self._fh.write(json.dumps({"schema_version": SCHEMA_VERSION, "kind": "env",
                                           "env_id": self.env_id, "time": now_iso(),
                                           "env": self.env}, separators=(",", ":"),
                                          allow_nan=True) + "\n")
        return self._fh

    def _stamp(self, record: Record) -> str:
        record.env_id = self.env_id
        record.kvbench_version = __version__
        record.git_commit = self.commit
        record.git_dirty = self.dirty
        record.command = record.command or self.command
        record.time = now_iso()
        self.count += 1
        return json.dumps(record.to_dict(), separators=(",", ":"), allow_nan=True) + "\n"

    def write(self, record: Record) -> Record:
        self.write_batch([record])
        return record

    def write_batch(self, records: list[Record]) -> None:
        """Write records with one write and one fsync: an interrupt keeps all or none."""
        if not records:
            return
        fh = self._open()
        fh.write("".join(self._stamp(r) for r in records))
        fh.flush()
        os.fsync(fh.fileno())

    def write_all(self, records: Iterable[Record]) -> None:
        for r in records:
            self.write(r)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class ResultSet:
    """What a result file holds: environments by id, records in file order, load warnings."""

    path: Path
    envs: dict[str, dict[str, Any]] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


_REQUIRED = ("kind", "name", "metric", "unit", "direction", "value", "status", "provenance")


def unit_key(rec: dict[str, Any]) -> str | None:
    """The suite unit a record belongs to: its case id, '@machine' when a fleet fanned it out
    to one machine; None outside suites."""
    method = rec.get("method") or {}
    case = method.get("suite_case")
    if case is None:
        return None
    return f"{case}@{method['machine']}" if method.get("machine") else case


def failed_attempt(rec: dict[str, Any]) -> bool:
    """A record of a unit that did not finish: the unit's own error record (metric "case":
    it raised, or its node was lost) or one cut short by an interrupt (method.partial)."""
    return (rec["status"] == "error" and rec["metric"] == "case") or \
        bool((rec.get("method") or {}).get("partial"))


def finished_units(records: Iterable[dict[str, Any]]) -> set[str]:
    """Units with at least one record of a finished attempt (measured, or waived)."""
    return {k for r in records if (k := unit_key(r)) is not None and not failed_attempt(r)}


def _drop_superseded(rs: ResultSet) -> None:
    """Records of failed attempts of a unit that a later resume finished are history: drop
    them (with a warning) so that reports and comparisons see the finished attempt only."""
    done = finished_units(rs.records)
    keep = [r for r in rs.records if not (failed_attempt(r) and unit_key(r) in done)]
    if len(keep) < len(rs.records):
        rs.warnings.append(f"{rs.path}: {len(rs.records) - len(keep)} record(s) of failed or "
                           "interrupted attempts superseded by a resumed run of the same unit")
        rs.records = keep


class _NotJson(Exception):
    """A line that is not a JSON object (a torn last line, or not JSON Lines at all)."""


def _parse(path: Path, i: int, line: str) -> dict[str, Any]:
    """Line i (0-based) of a result file as a record or env dict; _NotJson when it is not
    a JSON object, KvbenchError when it is not a kvbench line this version reads."""
    try:
        obj = json.loads(line)
    except ValueError:
        raise _NotJson from None
    if not isinstance(obj, dict):
        raise _NotJson
    version = obj.get("schema_version")
    if version is None or "kind" not in obj:
        raise KvbenchError(f"'{path}' line {i + 1} is not a kvbench record")
    if version not in KNOWN_SCHEMA_VERSIONS:
        raise KvbenchError(f"'{path}' line {i + 1}: schema version {version} is not known "
                           f"to kvbench {__version__} (knows {sorted(KNOWN_SCHEMA_VERSIONS)})")
    if obj["kind"] in ("probe", "run"):
        missing = [k for k in _REQUIRED if k not in obj]
        if missing:
            raise KvbenchError(f"'{path}' line {i + 1}: record lacks {', '.join(missing)}")
    elif obj["kind"] != "env":
        raise KvbenchError(f"'{path}' line {i + 1}: unknown record kind '{obj['kind']}'")
    return obj


def check_results_out(out: Path | str | None, what: str = "--out") -> None:
    """Before any work: `out` can take appended records (paths.check_out) and, when it holds
    something, is a kvbench result file (its first line read, not the whole file); without
    `out`, a new file in results/ (default_out_path) can be made."""
    if out is None:
        paths.check_out(RESULTS_DIR, "the results folder", folder=True)
        return
    found = paths.check_out(out, what)
    if found is None or not found.st_size:
        return
    try:
        with open_text(out) as f:
            i, line = next(((i, ln) for i, ln in enumerate(f) if ln.strip()), (0, ""))
        if line:
            _parse(Path(out), i, line)
    except _NotJson:
        raise KvbenchError(f"{what}: '{out}' line {i + 1} is not kvbench JSON Lines (results "
                           "are appended to it)") from None
    except KvbenchError as e:
        raise KvbenchError(f"{what}: {e} (results are appended to it)") from None
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise KvbenchError(f"{what}: cannot read '{out}': {e} (results are appended to "
                           "it)") from None


def load(path: Path | str) -> ResultSet:
    """Read a kvbench JSONL file; a torn last line is reported in warnings and skipped.

    Raises KvbenchError when the file is missing, is not kvbench JSON Lines, or has a
    schema version this kvbench does not know.
    """
    path = Path(path)
    found = paths.stat(path, "result file")
    if found is None:
        raise KvbenchError(f"result file '{paths.shown(path)}' does not exist")
    if not stat.S_ISREG(found.st_mode):
        raise KvbenchError(f"result file '{paths.shown(path)}' is not a file")
    try:
        lines = read_lines(path)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise KvbenchError(f"cannot read result file '{path}': {e}") from None
    rs = ResultSet(path)
    last = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = _parse(path, i, line)
        except _NotJson:
            if i == last:
                rs.warnings.append(f"{path}:{i + 1}: torn last line skipped (interrupted write)")
                continue
            raise KvbenchError(f"'{path}' line {i + 1} is not kvbench JSON Lines") from None
        if obj["kind"] == "env":
            rs.envs[obj["env_id"]] = obj.get("env", {})
        else:
            rs.records.append(obj)
    if not rs.envs and not rs.records:
        raise KvbenchError(f"'{path}' holds no kvbench records")
    _drop_superseded(rs)
    return rs


def open_text(path: Path | str, mode: str = "r") -> Any:
    """A text file of JSON Lines, gzip-compressed when its name ends in .gz (how the large
    records under results/ are committed; written with no timestamp, so the same records
    give the same bytes)."""
    path = Path(path)
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.GzipFile(path, mode + "b", mtime=0), encoding="utf-8")
    return path.open(mode, encoding="utf-8")


def read_lines(path: Path | str) -> list[str]:
    """Every line of a (possibly gzip-compressed) JSON Lines file."""
    with open_text(path) as f:
        return f.read().splitlines()


def slim(paths: Iterable[Path], out: Path, keep: tuple[str, ...]) -> list[dict[str, Any]]:
    """Copy result files into one without their bulky per-layer traces (the committed
    summary of a results folder): env lines and every record, except `trace.*` metrics
    other than the decode-phase ones named in `keep`. Returns the run records kept."""
    kept = []
    with open_text(out, "w") as f:
        for p in paths:
            for line in read_lines(p):
                r = json.loads(line)
                m = r.get("metric", "")
                if m.startswith("trace.") and not (m in keep and
                                                   r["params"].get("phase") == "decode"):
                    continue
                f.write(line + "\n")
                if r.get("kind") == "run":
                    kept.append(r)
    return kept


def to_dataframe(records: Iterable[dict[str, Any]]):  # -> pandas.DataFrame
    """One row per record; params flattened into `param.<name>` columns, stats into `stats.*`."""
    import pandas as pd

    rows = []
    for r in records:
        row = {k: v for k, v in r.items() if k not in ("params", "stats", "samples", "method")}
        row.update({f"param.{k}": v for k, v in (r.get("params") or {}).items()})
        row.update({f"stats.{k}": v for k, v in (r.get("stats") or {}).items()})
        row["n_samples"] = len(r.get("samples") or [])
        rows.append(row)
    return pd.DataFrame(rows)
