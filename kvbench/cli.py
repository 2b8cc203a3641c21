"""The kvbench command line: thin typer commands over the library.

Every failure the user can cause ends as one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import typer

from kvbench.errors import KvbenchError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Measure LLM inference when the KV cache no longer fits in GPU memory.")
probe_app = typer.Typer(no_args_is_help=True, help="Run a hardware probe (see `kvbench list`).")
app.add_typer(probe_app, name="probe")
run_app = typer.Typer(no_args_is_help=True,
                      help="Run a model under a KV strategy (see `kvbench list`).")
app.add_typer(run_app, name="run")


@app.command("env")
def env_cmd(
    as_json: bool = typer.Option(False, "--json", help="Print the record as JSON."),
    root: Path = typer.Option(Path("/"), hidden=True, help="Root of sysfs/procfs (tests)."),
) -> None:
    """Show the environment record stored with every result: CPU, NUMA, CXL, GPUs, versions."""
    from kvbench.envinfo import collect_env
    from kvbench.render import env_tables

    env = collect_env(root)
    if as_json:
        print(json.dumps(env, indent=2))
    else:
        env_tables(env)


@app.command("list")
def list_cmd(as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
             markdown: bool = typer.Option(False, "--markdown", help="Print the probes and "
                                           "the strategies as two Markdown tables (as in "
                                           "README.md).")) -> None:
    """List every registered probe and strategy, one line each."""
    if as_json and markdown:
        raise KvbenchError("give --json or --markdown, not both")
    if markdown:
        from kvbench.render import markdown_tables

        print(markdown_tables())
        return
    from kvbench.render import listing

    listing(as_json)


@app.command("compare")
def compare_cmd(
    base: Path = typer.Argument(..., help="Baseline result file (JSONL)."),
    new: Path | None = typer.Argument(None, help="New result file (default: BASE, to compare "
                                      "two machines of one fleet file)."),
    threshold: str = typer.Option("5%", help="Smallest relative change that counts."),
    alpha: float = typer.Option(0.05, min=1e-6, max=0.5, help="Significance level of the "
                                "whole comparison (Benjamini-Hochberg over the rows tested)."),
    metric: list[str] | None = typer.Option(None, help="Only metrics matching this glob "
                                            "(against 'metric' or 'name.metric'); repeatable."),
    fmt: str = typer.Option("table", "--format", help="table, markdown or json."),
    base_env: str | None = typer.Option(None, help="Only BASE's records of this machine: "
                                        "env id, fleet machine name or class, host name."),
    new_env: str | None = typer.Option(None, help="Only NEW's records of this machine."),
    noise: list[Path] | None = typer.Option(None, help="Noise calibration: a result file of "
                                            "3+ unchanged runs on this machine class; a "
                                            "change must exceed their run-to-run spread. "
                                            "Repeatable."),
) -> None:
    """Compare two result files (or two machines of one); exit 1 when anything regressed."""
    from kvbench.compare import check_format, check_globs, compare_sets, regressed, select_env
    from kvbench.noise import load_calibration
    from kvbench.render import compare_output
    from kvbench.store import load
    from kvbench.units import parse_fraction

    check_format(fmt)
    frac = parse_fraction(threshold, "threshold")
    if new is None and not (base_env and new_env):
        raise KvbenchError("give a NEW result file, or --base-env and --new-env to compare "
                           "two machines within BASE")
    old, cur = load(base), load(new or base)
    old = select_env(old, base_env) if base_env else old
    cur = select_env(cur, new_env) if new_env else cur
    check_globs(metric or [], old, cur)
    spreads = load_calibration([load(p) for p in noise], [old, cur]) if noise else None
    rows = compare_sets(old, cur, frac, alpha, metric, noise=spreads)
    compare_output(rows, fmt, frac, alpha)
    if regressed(rows):
        raise typer.Exit(1)


suite_app = typer.Typer(no_args_is_help=True, help="Run TOML suites of probes and strategies.")
app.add_typer(suite_app, name="suite")


@suite_app.command("run")
def suite_run_cmd(
    file: Path = typer.Argument(..., help="Suite file (TOML), e.g. suites/smoke.toml."),
    resume: bool = typer.Option(False, help="Skip cases already recorded in the output file."),
    only: str | None = typer.Option(None, help="Only cases whose label matches this glob."),
    out: Path | None = typer.Option(None, help="Result file (default: the suite's output)."),
    jobs: int = typer.Option(1, min=1, help="Run non-exclusive cases in this many local "
                             "processes (speed cases still run alone)."),
    ray: str | None = typer.Option(None, "--ray", help="Run each case as "
                                   "a Ray task: ADDRESS of a cluster, 'auto' to join the "
                                   "running one, no value for a local cluster."),
    on: str | None = typer.Option(None, help="With --ray: run every case once on each node "
                                  "of: all-nodes, all-gpu-nodes or CLASS[,CLASS...]."),
) -> None:
    """Run every case of a suite into one result file; exit 1 when a case errored."""
    from kvbench.console import wrote
    from kvbench.paths import check_out
    from kvbench.suite import load_suite, run_suite

    suite = load_suite(file)
    path = out or suite.output
    if on is not None and ray is None:
        raise KvbenchError("--on fans cases out over a Ray cluster: add --ray [ADDRESS]")
    if jobs > 1 and ray is not None:
        raise KvbenchError("--jobs is for one machine; with --ray each node runs as many "
                           "cases at once as it has CPU slots (ray start --num-cpus)")
    check_out(path, "--out" if out else "the suite's output")
    if ray is None:
        errors = run_suite(suite, path, resume, only, jobs)
    else:
        from kvbench.fleet import connect

        with connect(None if ray == "local" else ray, on or suite.machines) as fleet:
            errors = run_suite(suite, path, resume, only, fleet=fleet)
    wrote(path)
    if errors:
        raise typer.Exit(1)


@suite_app.command("check")
def suite_check_cmd(
    file: Path = typer.Argument(..., help="Suite file whose guard globs and threshold apply."),
    results: Path = typer.Argument(..., help="Result file of a run of that suite."),
    baseline: Path | None = typer.Option(None, help="Baseline (default: results/baselines/"
                                         "<machine-class>/<suite>.jsonl)."),
    fmt: str = typer.Option("table", "--format", help="table, markdown or json."),
) -> None:
    """Compare a suite's guarded metrics (each glob with its threshold) against the baseline;
    exit 1 when one regressed, when a guarded baseline quantity has no match in the results
    (its parameters changed: record a new baseline) or when none was found."""
    from kvbench.compare import check_format, compare_sets, regressed
    from kvbench.console import err_console
    from kvbench.render import compare_output
    from kvbench.store import load
    from kvbench.suite import baseline_path, load_suite

    check_format(fmt)
    suite = load_suite(file)
    new = load(results)
    base = load(baseline or baseline_path(suite, new))
    rows = []
    for glob, threshold in (suite.guard or {"*": suite.threshold}).items():
        for row in compare_sets(base, new, threshold, 0.05, glob, thresholded=True):
            row.marks.append(f"threshold {threshold:.0%}")
            rows.append(row)
    compare_output(rows, fmt, suite.threshold, 0.05)
    missing = [r for r in rows if r.verdict == "missing"]
    for r in missing:
        err_console.print(f"[red]error:[/] guarded {r.name}.{r.metric} of the baseline has no "
                          "match in the results (parameters changed? record a new baseline)")
    if regressed(rows) or missing or not rows:
        raise typer.Exit(1)


experiment_app = typer.Typer(no_args_is_help=True, help="Declared experiments "
                             "(experiments/NAME.toml): run their suites, render their tables.")
app.add_typer(experiment_app, name="experiment")


@experiment_app.command("list")
def experiment_list_cmd() -> None:
    """The declared experiments, their suites and whether their records are committed."""
    from kvbench.experiment import load_experiment, names

    for name in names():
        exp = load_experiment(name)
        have = sum(p.exists() for p in exp.records)
        print(f"{name}: {exp.title} ({len(exp.suites)} suites, {len(exp.tables)} tables, "
              f"records {have}/{len(exp.records)} present)")


@experiment_app.command("run")
def experiment_run_cmd(
    name: str = typer.Argument(..., help="Experiment name (experiments/NAME.toml) or path."),
    resume: bool = typer.Option(False, help="Continue the suites' outputs (cases already "
                                "recorded are skipped); without it an earlier output is "
                                "refused."),
    only: str | None = typer.Option(None, help="Only cases whose label (e.g. "
                                    "'quest[*budget_tokens=64*]*') or id matches this glob, "
                                    "measured again (with --resume: only those not recorded "
                                    "yet)."),
    project_only: bool = typer.Option(False, help="Only re-run the projections and "
                                      "derivations (seconds) from their sources; no suites."),
) -> None:
    """Run the experiment's suites and fold their records into its records file, then its
    projections and derivations; exit 1 when a case errored."""
    from kvbench.console import wrote
    from kvbench.experiment import derive, load_experiment, project, run

    exp = load_experiment(name)
    if project_only:
        project(exp)
        derive(exp)
        for out in dict.fromkeys([*(p.out for p in exp.projections),
                                  *(d.out for d in exp.derivations)]):
            wrote(out)
        return
    errors = run(exp, resume, only)
    wrote(exp.records[0])
    if errors:
        raise typer.Exit(1)


@experiment_app.command("render")
def experiment_render_cmd(
    name: str = typer.Argument(..., help="Experiment name (experiments/NAME.toml) or path."),
    check: bool = typer.Option(False, help="Write nothing; exit 1 when the committed "
                               "table.md differs from what the records render."),
) -> None:
    """Write results/NAME/table.md from the committed records only; exit 1 when a
    negative control shows a speed-up beyond its runs' noise."""
    from kvbench.console import wrote
    from kvbench.experiment import load_experiment, report

    exp = load_experiment(name)
    text, verdicts = report(exp)
    target = exp.out / "table.md"
    failed = [f"{c.title}: {v.run} {v.gain:+.1%} (allowed {v.allowed:.1%})"
              for c, found in verdicts for v in found if not v.ok]
    if check:
        same = target.exists() and target.read_text(encoding="utf-8") == text
        print(f"{target}: {'matches its records' if same else 'differs from its records'}")
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        wrote(target)
        same = True
    for line in failed:
        print(f"negative control failed: {line}")
    if failed or not same:
        raise typer.Exit(1)


@app.command("report")
def report_cmd(
    files: list[Path] = typer.Argument(..., help="Result files (JSONL)."),
    fmt: str = typer.Option("table", "--format", help="table, markdown or html."),
    out: Path | None = typer.Option(None, help="Folder for report.html / report.md + figures."),
) -> None:
    """Render result files: tables per probe/strategy, figures, environment, commands."""
    from kvbench.present.output import report

    report(files, fmt, out)


hardware_app = typer.Typer(no_args_is_help=True, help="Hardware profiles for `kvbench project`.")
app.add_typer(hardware_app, name="hardware")


@hardware_app.command("list")
def hardware_list_cmd() -> None:
    """List the shipped hardware profiles."""
    from kvbench.hwmodel.cli import show_list

    show_list()


@hardware_app.command("show")
def hardware_show_cmd(
    name: str = typer.Argument(..., help="Profile name, FILE.toml, or 'this'."),
    probes: list[Path] | None = typer.Option(None, help="Probe result files ('this')."),
) -> None:
    """Every field of a profile with its source."""
    from kvbench.hwmodel.cli import show

    show(name, probes or [])


@app.command("project")
def project_cmd(
    results: Path = typer.Argument(..., help="Result file with run traces (JSONL)."),
    hardware: list[str] = typer.Option(..., help="Profile name, FILE.toml or 'this'; "
                                       "repeatable."),
    probes: list[Path] | None = typer.Option(None, help="Probe result files for 'this' "
                                             "(default: the results file's own probes, "
                                             "else `kvbench calibrate`'s)."),
    memory: str = typer.Option("pinned", help="Host memory of copies: pinned or pageable."),
    out: Path | None = typer.Option(None, help="Result file (default: new file in results/)."),
    model: str | None = typer.Option(None, help="Project onto this model's shape (the run's "
                                     "selection statistics carried over)."),
    batch: int = typer.Option(1, help="With --model: the target batch."),
    prompt_len: int = typer.Option(1920, help="With --model: the target prompt length."),
    gen_len: int = typer.Option(128, help="With --model: the target decode steps."),
    dtype: str = typer.Option("float16", help="With --model: the target dtype."),
    bookkeeping: str = typer.Option("measured", help="Bookkeeping without a work model: "
                                    "measured (carried over) or none."),
    gpus: int | None = typer.Option(None, help="Accelerators (tensor parallel, ideal) in "
                                    "place of the profile's one (CXL-PNM GPU counts)."),
    pnms: int | None = typer.Option(None, help="PNM devices (data parallel, ideal) in place "
                                    "of the profile's one; 0 drops them (baseline)."),
    skip_steps: int = typer.Option(0, help="Leave the first N decode steps out of the "
                                   "decode metrics (warm-up, e.g. png-kv's pool fill)."),
) -> None:
    """Re-time every run of RESULTS on hardware profiles; projected records."""
    from kvbench.hwmodel.cli import project, target_shape

    if bookkeeping not in ("measured", "none"):
        raise KvbenchError(f"--bookkeeping '{bookkeeping}': measured or none")
    project(results, hardware, probes or [], memory, out,
            target_shape(model, batch, prompt_len, gen_len, dtype), bookkeeping == "measured",
            gpus, pnms, skip_steps)


@app.command("calibrate")
def calibrate_cmd(
    model: list[str] | None = typer.Option(None, help="Model whose shapes to probe at "
                                           "(default smollm2-135m); repeatable."),
    batch: str = typer.Option("1,8", help="Batch sizes the projections run at."),
    dtype: str = typer.Option("auto", help="The accelerator's dtype: float32, bfloat16, "
                              "float16 or auto (float32 on a CPU, bfloat16 with CUDA)."),
    quick: bool = typer.Option(False, help="Shorter probes (a quick look; noisier)."),
) -> None:
    """Probe this machine once for `kvbench project --hardware this`; stored in the cache."""
    from kvbench.console import err_console
    from kvbench.hwmodel.calibrate import CalibrateConfig, calibrate, show

    show(calibrate(CalibrateConfig.of(model or [], batch, dtype, quick),
                   lambda line: err_console.print(f"calibrate {line}")))


@app.command("roi")
def roi_cmd(
    gpu_tflops: float = typer.Option(100.0, help="P: the GPU's compute, TFLOP/s."),
    prefill_tflop: float = typer.Option(25.0, help="C0: FLOPs of an initial prefill, TFLOP "
                                        "(ignored with --model)."),
    model: str = typer.Option("", help="C0 = 2 M L from this model's parameters M..."),
    tokens: int = typer.Option(2048, help="...and L, the average request length in tokens."),
    new_ratio: float = typer.Option(0.1, help="r: a follow-up's new-prompt share."),
    slo: float = typer.Option(0.4, help="T_slo: the TTFT SLO, seconds."),
    load_time: float = typer.Option(0.1, help="T_load: time to load a prefix's KV, seconds."),
    h: str = typer.Option("0.25,0.5,0.75,1", help="Follow-up shares h, comma-separated."),
    demand: float = typer.Option(100.0, help="R: requests per second to serve."),
    out: Path | None = typer.Option(None, help="Also write the projected records here."),
) -> None:
    """The CXL KV-storage paper's ROI model: requests/s per GPU and GPUs needed, per h."""
    from kvbench.prefix import roi

    if out is not None:
        from kvbench.store import check_results_out

        check_results_out(out)
    c0 = prefill_tflop * 1e12
    if model:
        from kvbench.models import get_spec

        c0 = roi.prefill_flops(get_spec(model).params(), tokens)
    x = roi.RoiInputs(gpu_tflops * 1e12, c0, new_ratio, slo, load_time, demand)
    try:
        shares = [float(v) for v in h.split(",") if v.strip()]
    except ValueError:
        raise KvbenchError(f"--h '{h}': comma-separated numbers in [0, 1]") from None
    if not shares:
        raise KvbenchError(f"--h '{h}' names no follow-up share: comma-separated numbers "
                           "in [0, 1]")
    rows = [roi.roi(x, v) for v in shares]
    source = model or "given"
    roi.show(x, rows, source)
    if out is not None:
        from kvbench.console import wrote
        from kvbench.envinfo import collect_env
        from kvbench.store import ResultWriter

        with ResultWriter(out, collect_env()) as w:
            w.write_all(roi.records(x, rows, source))
        wrote(out)


_ADDED: list[tuple[typer.Typer, object]] = []  # the commands _add_registered_commands added
_BUILT: dict[tuple[tuple[str, ...], tuple[str, ...]], object] = {}


def _add_registered_commands() -> None:
    """The registered probes and strategies (and the commands built from config classes) as
    commands of `app`, replacing those an earlier call added."""
    from kvbench import plan
    from kvbench.options import config_command
    from kvbench.probes import PROBES, probe_command
    from kvbench.runtime.command import make_command
    from kvbench.strategies import STRATEGIES

    for typer_app, info in _ADDED:
        typer_app.registered_commands.remove(info)
    _ADDED.clear()

    def add(typer_app: typer.Typer, name: str, help: str, fn: object) -> None:
        typer_app.command(name, help=help)(fn)
        _ADDED.append((typer_app, typer_app.registered_commands[-1]))

    for cls in PROBES.all():
        add(probe_app, cls.name, cls.summary(), probe_command(cls))
    for cls in STRATEGIES.all():
        add(run_app, cls.name, cls.summary(), make_command(cls))
    serve = PROBES.get("serve-sim")  # also top-level, as docs/prefix-cache.md names it
    add(app, "serve-sim", serve.description, probe_command(serve))
    doc = "Capacity and cost of GPU / CXL-PNM configurations (projected; CXL-PNM Fig. 1a, Table 3)."
    add(app, "plan", doc, config_command([(plan.PlanConfig, None)], plan.run, doc,
                                         results=False))  # --out: a JSON file


def command() -> typer.core.TyperGroup:
    """`kvbench` as a click command, built once per set of registered probes and strategies
    (building it takes about 0.2 s; a test may register more)."""
    from kvbench.probes import PROBES
    from kvbench.strategies import STRATEGIES

    key = (tuple(c.name for c in PROBES.all()), tuple(c.name for c in STRATEGIES.all()))
    if key not in _BUILT:
        _add_registered_commands()
        _BUILT.clear()
        _BUILT[key] = typer.main.get_command(app)
    return _BUILT[key]


def _is_abort(e: BaseException) -> bool:
    return type(e).__name__ == "Abort"


class Terminated(BaseException):
    """SIGTERM (what schedulers send) outside a run's decode loop, which handles its own.
    A BaseException, as KeyboardInterrupt: a suite's per-case `except Exception` must not
    record it as the case's error and go on to the next case."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated(signum)


def main(argv: list[str] | None = None) -> None:
    """Entry point: runs the app and turns every user error into one line and exit 2.

    Click's exceptions are recognised by shape, not class, because typer >= 0.26 vendors its
    own copy of click while older typers use the click package.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    # torch's allocations of 2 MiB and more on 2 MiB pages where the kernel allows them
    # (read once, at torch's first such allocation; a user's own setting stands): a sparse
    # step reads 4 KiB pages of KV scattered over each row's cache, a TLB miss apiece.
    # Measured at the KV-bound point (results/kv-bound-speed/checks-2026-11-27-session4.txt):
    # full attention 3.4% and Quest 4.9% faster a step, ArkVale and StreamingLLM unchanged.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, arg in enumerate(argv):  # `--ray` without an address: a local cluster
        if arg == "--ray" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            argv.insert(i + 1, "local")
            break
    try:
        code = command().main(args=argv, prog_name="kvbench", standalone_mode=False)
    except KvbenchError as e:
        print(f"kvbench: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("kvbench: interrupted (finished records are saved)", file=sys.stderr)
        sys.exit(130)
    except Terminated:
        print("kvbench: terminated (finished records are saved)", file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)
    except Exception as e:
        if _is_abort(e):
            print("kvbench: interrupted (finished records are saved)", file=sys.stderr)
            sys.exit(130)
        if not hasattr(e, "format_message"):
            raise
        message = " ".join(e.format_message().split())
        print(f"kvbench: error: {message}", file=sys.stderr)
        sys.exit(2)
    if code == 130:  # typer turns Ctrl-C into Exit(130) before it reaches the handler above
        print("kvbench: interrupted (finished records are saved)", file=sys.stderr)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
