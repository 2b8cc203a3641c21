"""The library behind `kvbench hardware list|show` and `kvbench project` (thin commands)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvbench.errors import require
from kvbench.hwmodel.profile import Profile, load, names, rows
from kvbench.hwmodel.scale import Shape
from kvbench.models import ModelSpec

if TYPE_CHECKING:
    from kvbench.schema import Record

THIS_PROBES = ("roofline", "attention", "bandwidth", "timer")


def this_records(probe_files: list[Path], results: list[dict], models: list[str]
                 ) -> list[dict]:
    """The probe records 'this' is built from: the --probes files' (with the results file's
    own), else the results file's own probes of `this` when it has any, else this
    machine's calibration for `models` (kvbench.hwmodel.calibrate.stored: one line naming
    the `kvbench calibrate` command when there is none or it is stale)."""
    from kvbench.store import load as load_results

    own = [r for r in results if r.get("kind") == "probe" and r.get("name") in THIS_PROBES]
    if probe_files:
        return [r for f in probe_files for r in load_results(f).records] + own
    if own:
        return own
    from kvbench.hwmodel.calibrate import stored

    return stored(models)


def resolve(name: str, probe_files: list[Path], results: list[dict] | None = None,
            spec: ModelSpec | None = None, this: list[dict] | None = None) -> Profile:
    """A profile by name / file, or 'this' from probe records (`this`, else this_records)
    at `spec`'s shapes; checked for the graph's fields."""
    if name != "this":
        return load(name).check()
    from kvbench.hwmodel.this import build

    if this is None:
        this = this_records(probe_files, list(results or []), [spec.name] if spec else [])
    return build(this, spec).check()


def show_list() -> None:
    from rich.table import Table

    from kvbench.console import console

    t = Table(title="hardware profiles (kvbench project --hardware NAME)")
    for col in ("name", "description"):
        t.add_column(col)
    for n in names():
        t.add_row(n, str(load(n).tables and _doc(n)))
    t.add_row("this", "built from this machine's probe results (--probes FILE)")
    console.print(t)


def _doc(name: str) -> str:
    from kvbench.hwmodel.profile import PROFILES, _read

    return str(_read(PROFILES / f"{name}.toml", "hardware profile").get("description", ""))


def show(name: str, probe_files: list[Path]) -> None:
    from rich.table import Table

    from kvbench.console import console

    require(not probe_files or name == "this", f"--probes: only 'this' is built from probe "
            f"files; '{name}' is not")
    p = resolve(name, probe_files)
    t = Table(title=f"hardware profile {p.name} ({p.path})")
    for col in ("field", "value", "source"):
        t.add_column(col, overflow="fold")
    for field, value, source in rows(p):
        t.add_row(field, value, source)
    console.print(t)


def target_shape(model: str | None, batch: int, prompt_len: int, gen_len: int,
                 dtype: str) -> Shape | None:
    """The --model/--batch/--prompt-len/--gen-len/--dtype target of a scaled projection."""
    from kvbench.models import get_spec
    from kvbench.units import dtype_name

    if model is None:
        return None
    require(batch >= 1 and prompt_len >= 1 and gen_len >= 1,
            "--batch, --prompt-len and --gen-len must be at least 1")
    elem = {"float32": 4}.get(dtype_name(dtype), 2)
    return Shape(get_spec(model), batch, prompt_len, gen_len, elem)


def profile_at(name: str, probe_files: list[Path], results: list[dict],
               spec: ModelSpec | None, gpus: int | None = None, pnms: int | None = None,
               this: list[dict] | None = None) -> Profile:
    """`resolve`'s profile, replicated to `gpus` GPUs and `pnms` PNMs when either is given
    (the other one then counts 1)."""
    p = resolve(name, probe_files, results, spec, this)
    if gpus is None and pnms is None:
        return p
    from kvbench.hwmodel.profile import replicate

    return replicate(p, 1 if gpus is None else gpus, 1 if pnms is None else pnms)


def projected(src: list[dict], label: str, hardware: list[str], probe_files: list[Path],
              memory: str, target: Shape | None = None, carried: bool = True,
              gpus: int | None = None, pnms: int | None = None, skip: int = 0
              ) -> tuple[list[Record], int]:
    """The projected records of every run in `src` (records of the file `label`) on every
    profile of `hardware`, and the number of runs; every profile is resolved before the
    first run is re-timed, so bad input raises before any work (KvbenchError)."""
    from kvbench.hwmodel.project import records, runs

    require(memory in ("pinned", "pageable"), f"--memory '{memory}': pinned or pageable")
    require(skip >= 0, f"--skip-steps {skip}: must be >= 0")
    groups = runs(src, label)
    specs = {key: target.spec if target else _spec(recs[0]["params"])
             for key, recs in groups.items()}
    this = this_records(probe_files, src, sorted({s.name for s in specs.values() if s})) \
        if "this" in hardware else None

    def at(h: str, spec: ModelSpec | None) -> tuple[str, str]:  # 'this' is per model
        return h, spec.name if spec is not None and h == "this" else ""

    profiles: dict[tuple[str, str], Profile] = {}
    for h in hardware:
        for spec in specs.values():
            if at(h, spec) not in profiles:
                profiles[at(h, spec)] = profile_at(h, probe_files, src, spec, gpus, pnms, this)
    out = [rec for h in hardware for key, recs in groups.items()
           for rec in records(recs, profiles[at(h, specs[key])], memory, target, carried,
                              skip)]
    return out, len(groups)


def project(results: Path, hardware: list[str], probe_files: list[Path], memory: str,
            out: Path | None, target: Shape | None = None, carried: bool = True,
            gpus: int | None = None, pnms: int | None = None, skip: int = 0) -> None:
    """`kvbench project`: the projected records of RESULTS written to `out`."""
    from kvbench.console import err_console, wrote
    from kvbench.envinfo import collect_env
    from kvbench.store import ResultWriter, check_results_out, default_out_path
    from kvbench.store import load as load_results

    check_results_out(out)
    require(not probe_files or "this" in hardware, "--probes: only --hardware this is built "
            "from probe files")
    recs, n_runs = projected(load_results(results).records, str(results), hardware,
                             probe_files, memory, target, carried, gpus, pnms, skip)
    path = out or default_out_path("project")
    with ResultWriter(path, collect_env()) as w:
        w.write_all(recs)
    wrote(path)
    err_console.print(f"{len(recs)} projected records: {n_runs} run(s) x {len(hardware)} "
                      "profile(s)")


def _spec(params: dict) -> ModelSpec | None:
    """The model spec a run's trace records name (None when they name none)."""
    from kvbench.models import get_spec

    return get_spec(str(params["model"])) if "model" in params else None
