"""Suites: TOML files of cases run into one result file, resumable case by case.

    [suite]
    name = "smoke"                    # baselines: results/baselines/<machine-class>/<name>.jsonl
    output = "results/smoke.jsonl"    # relative to the current directory
    repetitions = 1                   # default for every case
    order = "round"                   # every case's repetition r before any case's r + 1
                                      # (drift hits every case alike; default "case": a
                                      # case's repetitions back to back)
    threshold = "10%"                 # default smallest relative change that counts
    machines = ["a100", "cxl"]        # --ray: run every case on each node of these classes

    [suite.guard]                     # 'name.metric' globs `kvbench suite check` compares,
    "attention.bar.*" = "45%"         # each with its threshold (or: guard = ["glob", ...])

    [[case]]
    probe = "timer"                   # or: strategy = "full"
    params = { calls = 2000 }         # probe: `config` fields; strategy: RunConfig + `params`
    sweep = { reps = [5, 9] }         # cartesian product over these fields
    repetitions = 3
    requires = "gpu"                  # recorded as waived where there is no CUDA GPU
    resources = { cxl = 1 }           # --ray: custom resources of the nodes it may run on
    exclusive = false                 # may share the machine under --jobs (default: only
                                      # strategy cases in eval/passkey mode may)

    [[ratio]]                         # derived after the cases, from records of this run
    name = "native_over_host_clock"
    numerator = "timer.native_clock_overhead"
    denominator = "timer.perf_counter_ns_overhead"
    direction = "lower"
    match = ["calls"]                 # parameters that must agree to pair records (default none)
    where = { calls = 20000 }         # parameter values a record must have (default any)

Each (case, sweep point, repetition) is one unit of work with a stable id (a hash of kind,
name, explicit parameters and repetition) kept in every record's `method["suite_case"]`.
A unit's records are written as one batch (one write, one fsync) once it finishes, so a
unit is either wholly in the output file or absent: `--resume` skips exactly the units
present. An interrupt (Ctrl-C, SIGTERM) stops the unit that was running and keeps the
records it had finished, marked `method.partial` (a strategy case's run is sent the signal
and stores the decode steps it finished). A unit that errored or was cut short is not done:
`--resume` runs it again, and the loader then drops the failed attempt's records
(store.unit_key, store.failed_attempt). Under `--jobs`, units running in worker processes
when the interrupt comes are lost whole.
`--jobs N` (kvbench.suite_jobs) and `--ray` (kvbench.fleet) run units elsewhere; this
process stays the one writer of the file.
"""

from __future__ import annotations

import json
import re
import shlex
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.schema import Record, measured, not_measured
from kvbench.store import ResultSet
from kvbench.suite_spec import Case, RatioSpec, Suite, load_suite
from kvbench.suite_units import CaseInterrupted, Unit, units

__all__ = ["Case", "Suite", "Unit", "baseline_path", "load_suite", "machine_class", "run_suite",
           "units"]


def machine_class(env: dict[str, Any]) -> str:
    """'gpu-h100' (first GPU's model, 'x2' etc. when several) or 'cpu-2c-x86_64'."""
    gpus = env.get("gpus") or []
    if gpus:
        words = re.findall(r"[a-z]*\d+[a-z]*", gpus[0]["name"].lower().replace("nvidia", ""))
        model = words[0] if words else "unknown"
        return f"gpu-{model}" + (f"x{len(gpus)}" if len(gpus) > 1 else "")
    cpu = env["cpu"]
    return f"cpu-{cpu['logical_cpus']}c-{cpu['arch']}"


def machine_label(env: dict[str, Any]) -> str:
    """'class (name)': a fleet node's class and Ray node name, else the hardware class and
    host name (machine_class)."""
    node = env.get("node")
    if node:
        return f"{node['class']} ({node['name']})"
    return f"{machine_class(env)} ({env.get('hostname', '?')})"


def baseline_path(suite: Suite, results: ResultSet) -> Path:
    """results/baselines/<machine class of the results' environment>/<suite name>.jsonl."""
    from kvbench.store import REPO_ROOT

    if not results.envs:
        raise KvbenchError(f"'{results.path}' has no environment line to pick a baseline by")
    cls = machine_class(next(iter(results.envs.values())))
    path = REPO_ROOT / "results" / "baselines" / cls / f"{suite.name}.jsonl"
    if not path.exists():
        raise KvbenchError(f"no baseline for machine class '{cls}': {path} (record one with "
                           f"`kvbench suite run {suite.path} --out {path}`)")
    return path


def recorded_units(path: Path) -> set[str]:
    """Keys of the units finished in result file `path` (store.unit_key: the case id, with
    '@machine' for a fleet fan-out). A unit whose records are its error or are marked
    partial (interrupted) is not finished: `--resume` runs it again."""
    from kvbench.store import finished_units, load

    if not path.exists() or not path.stat().st_size:
        return set()
    return finished_units(load(path).records)


def derive_ratio(spec: RatioSpec, records: list[dict[str, Any]]) -> Iterator[Record]:
    """Ratio records of numerator over denominator samples, paired by common parameters,
    of the records whose parameters have the spec's `where` values.

    Samples are paired by index (repetitions pooled first), so the ratio keeps a spread
    that `compare` can test; both quantities come from the same run of the suite.
    """
    def pick(ref: str) -> dict[str, tuple[dict[str, Any], list[float]]]:
        name, _, metric = ref.partition(".")
        out: dict[str, tuple[dict[str, Any], list[float]]] = {}
        for r in records:
            if (r["name"] == name and r["metric"] == metric and r["status"] == "ok"
                    and all(r["params"].get(k) == v for k, v in spec.where)):
                common = {k: v for k, v in r["params"].items() if k in spec.match}
                key = json.dumps(common, sort_keys=True)
                out.setdefault(key, (common, []))[1].extend(r.get("samples") or [r["value"]])
        return out

    num, den = pick(spec.numerator), pick(spec.denominator)
    method = {"numerator": spec.numerator, "denominator": spec.denominator,
              "statistic": "median of index-paired sample ratios"}
    keys = [k for k in num if k in den]
    for key in keys:
        params, top = num[key]
        pairs = [a / b for a, b in zip(top, den[key][1], strict=False) if b]
        if not pairs:
            yield not_measured("probe", "ratio", spec.name, "error", "zero denominator", params)
            continue
        yield measured("probe", "ratio", spec.name, "x", spec.direction, pairs, params, method)
    if not keys:
        yield not_measured("probe", "ratio", spec.name, "waived",
                           f"{spec.numerator} or {spec.denominator} not measured in this run")


class _Sink:
    """The one writer of the result file: each unit's records as one batch, stamped with the
    suite, unit and (fleet) machine, under the environment of the machine that ran them."""

    def __init__(self, out: Path, suite: Suite, env: dict[str, Any], jobs: int) -> None:
        self.out, self.suite, self.env, self.jobs = out, suite, env, jobs
        self.writers: dict[str, Any] = {}

    def write(self, unit: Unit, records: list[Record], env: dict[str, Any] | None,
              concurrent: bool) -> None:
        env = env or self.env
        for rec in records:
            rec.version = unit.case.version
            rec.command = unit.command()
            rec.method.update({"suite": str(self.suite.path), "suite_case": unit.case_id,
                               "suite_repetition": unit.rep})
            if unit.machine:
                rec.method["machine"] = unit.machine
            if concurrent:  # its machine ran other cases meanwhile (a non-exclusive case)
                rec.method["concurrent_jobs"] = self.jobs
        self._writer(env).write_batch(records)

    def _writer(self, env: dict[str, Any]) -> Any:
        from kvbench.store import ResultWriter

        cmd = shlex.join(["kvbench", "suite", "run", str(self.suite.path)])
        if env["env_id"] not in self.writers:
            self.writers[env["env_id"]] = ResultWriter(self.out, env, command=cmd)
        return self.writers[env["env_id"]]

    def ratios(self, results: ResultSet) -> None:
        """The suite's ratios not yet in the file, from each machine's own records. A
        machine is a fleet node by name, else a host: a resumed run's records pool with the
        interrupted run's even where their environments differ (threads, git state), and
        the ratio is filed under the machine's latest environment."""
        machines: dict[str, list[str]] = defaultdict(list)
        for env_id, env in results.envs.items():
            machines[(env.get("node") or {}).get("name") or env.get("hostname", "")].append(
                env_id)
        for ids in machines.values():
            have = [r for r in results.records if r["env_id"] in ids]
            derived = {r["metric"] for r in have if r["name"] == "ratio"}
            if not any(r["name"] != "ratio" for r in have):
                continue
            env_id = ids[-1]
            for spec in self.suite.ratios:
                if spec.name not in derived:
                    self._writer({**results.envs[env_id], "env_id": env_id}).write_batch(
                        list(derive_ratio(spec, have)))

    def close(self) -> None:
        for w in self.writers.values():
            w.close()


def run_suite(suite: Suite, out: Path, resume: bool = False, only: str | None = None,
              jobs: int = 1, fleet: Any = None) -> int:
    """Run the suite into `out`; returns the number of units that ended in an error.

    jobs > 1 runs non-exclusive cases in that many local worker processes (exclusive ones
    alone); `fleet` (kvbench.fleet.Fleet) runs every unit as a Ray task instead. Either way
    the records of each unit are appended here as the unit finishes, in any order."""
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvbench.console import err_console
    from kvbench.envinfo import collect_env
    from kvbench.store import load
    from kvbench.suite_jobs import run_local

    if out.exists() and out.stat().st_size and not resume:
        raise KvbenchError(f"'{out}' already holds results: pass --resume to continue it, "
                           "or --out a new file")
    todo = units(suite, only)
    if not todo:
        raise KvbenchError(f"--only '{only}' matches no case of {suite.path} (labels such as "
                           f"'{units(suite)[0].label}', or case ids)")
    if fleet is not None:
        todo = fleet.plan(todo)
    done = recorded_units(out) if resume else set()
    pending = [u for u in todo if u.key not in done]
    if resume:
        err_console.print(f"resume: {len(todo) - len(pending)} of {len(todo)} cases already "
                          f"in {out}")
    errors = 0
    sink = _Sink(out, suite, fleet.env if fleet is not None else collect_env(), jobs)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err_console) as bar:
            task = bar.add_task(suite.name, total=len(pending))
            results = fleet.run(suite, pending) if fleet is not None else \
                run_local(suite, pending, jobs)
            try:
                for unit, records, env, concurrent in results:
                    sink.write(unit, records, env, concurrent)
                    status = records[0].status if len(records) == 1 else "ok"
                    where = f" on {unit.machine}" if unit.machine else ""
                    if status != "ok":
                        errors += status == "error"
                        bar.console.print(escape(f"{unit.label}{where}: {status} "
                                                 f"{records[0].reason}"))
                    bar.update(task, advance=1, description=escape(
                        f"{suite.name}: {unit.label}{where}"))
            except CaseInterrupted as e:  # what the running unit finished, marked partial
                if e.records:
                    sink.write(e.unit, e.records, None, False)
                    bar.console.print(escape(f"{e.unit.label}: interrupted, {len(e.records)} "
                                             "record(s) kept, marked partial"))
                raise e.cause from None
            if suite.ratios and only is None:
                sink.ratios(load(out))
    finally:
        sink.close()
    return errors
