"""The kvbench command line: thin typer commands over the library.

Every failure the user can cause ends as one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
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
def list_cmd(as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """List every registered probe and strategy, one line each."""
    from kvbench.render import listing

    listing(as_json)


@app.command("compare")
def compare_cmd(
    base: Path = typer.Argument(..., help="Baseline result file (JSONL)."),
    new: Path = typer.Argument(..., help="New result file (JSONL)."),
    threshold: str = typer.Option("5%", help="Smallest relative change that counts."),
    alpha: float = typer.Option(0.05, min=1e-6, max=0.5, help="Significance level of the test."),
    metric: list[str] | None = typer.Option(None, help="Only metrics matching this glob "
                                            "(against 'metric' or 'name.metric'); repeatable."),
    fmt: str = typer.Option("table", "--format", help="table, markdown or json."),
) -> None:
    """Compare two result files; exit 1 when anything regressed."""
    from kvbench.compare import compare_sets, regressed
    from kvbench.render import compare_output
    from kvbench.store import load
    from kvbench.units import parse_fraction

    if fmt not in ("table", "markdown", "json"):
        raise KvbenchError(f"unknown format '{fmt}' (table, markdown or json)")
    frac = parse_fraction(threshold, "threshold")
    rows = compare_sets(load(base), load(new), frac, alpha, metric)
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
) -> None:
    """Run every case of a suite into one result file; exit 1 when a case errored."""
    from kvbench.console import wrote
    from kvbench.suite import load_suite, run_suite

    suite = load_suite(file)
    path = out or suite.output
    errors = run_suite(suite, path, resume, only)
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
    from kvbench.compare import compare_sets, regressed
    from kvbench.console import err_console
    from kvbench.render import compare_output
    from kvbench.store import load
    from kvbench.suite import baseline_path, load_suite

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


@app.command("report")
def report_cmd(
    files: list[Path] = typer.Argument(..., help="Result files (JSONL)."),
    fmt: str = typer.Option("table", "--format", help="table, markdown or html."),
    out: Path | None = typer.Option(None, help="Folder for report.html / report.md + figures."),
) -> None:
    """Render result files: tables per probe/strategy, figures, environment, commands."""
    from kvbench.report import report

    report(files, fmt, out)


def _add_registered_commands() -> None:
    from kvbench import plan
    from kvbench.options import config_command
    from kvbench.probes import PROBES
    from kvbench.runtime.command import make_command
    from kvbench.strategies import STRATEGIES

    for cls in PROBES.all():
        probe_app.command(cls.name, help=cls.summary())(cls.cli)
    for cls in STRATEGIES.all():
        run_app.command(cls.name, help=cls.summary())(make_command(cls))
    doc = "Capacity and cost of GPU / CXL-PNM configurations (projected; CXL-PNM Fig. 1a, Table 3)."
    app.command("plan", help=doc)(config_command([(plan.PlanConfig, None)], plan.run, doc))


def _is_abort(e: BaseException) -> bool:
    return type(e).__name__ == "Abort"


class Terminated(Exception):
    """SIGTERM (what schedulers send) outside a run's decode loop, which handles its own."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated(signum)


def main(argv: list[str] | None = None) -> None:
    """Entry point: runs the app and turns every user error into one line and exit 2.

    Click's exceptions are recognised by shape, not class, because typer >= 0.26 vendors its
    own copy of click while older typers use the click package.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    try:
        _add_registered_commands()
        code = app(args=argv, prog_name="kvbench", standalone_mode=False)
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
