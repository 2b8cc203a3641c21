"""The kvbench command line: thin typer commands over the library.

Every failure the user can cause ends as one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from kvbench.errors import KvbenchError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Measure LLM inference when the KV cache no longer fits in GPU memory.")
probe_app = typer.Typer(no_args_is_help=True, help="Run a hardware probe (see `kvbench list`).")
app.add_typer(probe_app, name="probe")


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
    metric: str | None = typer.Option(None, help="Only metrics matching this glob "
                                      "(against 'metric' or 'name.metric')."),
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


def _add_registered_commands() -> None:
    from kvbench.probes import PROBES

    for cls in PROBES.all():
        probe_app.command(cls.name, help=cls.summary())(cls.cli)


def _is_abort(e: BaseException) -> bool:
    return type(e).__name__ == "Abort"


def main(argv: list[str] | None = None) -> None:
    """Entry point: runs the app and turns every user error into one line and exit 2.

    Click's exceptions are recognised by shape, not class, because typer >= 0.26 vendors its
    own copy of click while older typers use the click package.
    """
    try:
        _add_registered_commands()
        code = app(args=argv, prog_name="kvbench", standalone_mode=False)
    except KvbenchError as e:
        print(f"kvbench: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("kvbench: interrupted (finished records are saved)", file=sys.stderr)
        sys.exit(130)
    except Exception as e:
        if _is_abort(e):
            print("kvbench: interrupted (finished records are saved)", file=sys.stderr)
            sys.exit(130)
        if not hasattr(e, "format_message"):
            raise
        message = " ".join(e.format_message().split())
        print(f"kvbench: error: {message}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
