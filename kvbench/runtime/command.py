"""`kvbench run STRATEGY`: one typer command per registered strategy, built from the registry.

Each command has the shared run options (RunConfig fields) followed by the strategy's own
parameters (fields of its `params` dataclass, help from the field's "help" metadata) and
`--out`. `execute` is the command around the engine (kvbench.runtime.engine.run: validate,
refuse what cannot fit, load, warm up, decode, count, optionally time transformers'
`generate` side by side): a loading status, notes, a progress bar, SIGTERM/SIGINT stopping
after the step in progress, the records stored and a summary table printed.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from kvbench.runtime.run import RunConfig
from kvbench.schema import Record
from kvbench.strategies import Strategy

_HELP = {
    "model": "Model spec name (see `kvbench list`).",
    "weights": "bundled, random, or a local Hugging Face checkpoint directory "
               "(auto: bundled for smollm2-135m, random otherwise).",
    "layers": "Run only the first N layers (0: all); every record says so.",
    "batch": "Sequences decoded together.",
    "prompt_len": "Prompt tokens per sequence.",
    "gen_len": "Decode steps (tokens generated per sequence after the first).",
    "dtype": "auto (bfloat16 on cuda, float32 on cpu), float32/fp32, bfloat16/bf16 or "
             "float16/fp16.",
    "device": "Accelerator role: auto (cuda when present, else cpu), cpu or cuda.",
    "mode": "generate (greedy), eval (teacher-forced perplexity, HGCA Table 1 method) or "
            "passkey (retrieve a key hidden at --depth of a --prompt-len prompt, Quest "
            "Table 1).",
    "text": "Text file for prompts and eval targets (default: /usr/share/common-licenses/*).",
    "threads": "Torch CPU threads (0: torch's default).",
    "seed": "Seed of random weights.",
    "compare_hf": "Also time transformers' generate on the same prompt, dtype and threads.",
    "depth": "Passkey mode: where the key sits in the prompt, 0 (start) to 1 (end).",
    "task": "Passkey mode's task: passkey (one key), or RULER-style multikey (4 keyed "
            "needles, one asked), multivalue (4 values of one key, all asked) or vartrack (a "
            "chain of 4 variable assignments, every variable asked); needles from --depth.",
    "turns": "Conversation turns: each later turn appends --prompt-len new prompt tokens to "
             "the cache, then decodes --gen-len more (strategies with append only).",
    "prefix_cache": "Prefix cache tier (CXL KV-storage paper): accel, host:N (NUMA node) or "
                    "disk:PATH; before each later turn, save the KV and time that turn's "
                    "request as recompute, load from the tier and accelerator-resident.",
    "prefix_capacity": "Prefix cache capacity, e.g. 512M (0: twice the run's largest save); "
                       "least-recently-used entries are evicted.",
    "prefix_chunk": "Tokens per prefix-cache chunk (hashed over its prefix, as vLLM's blocks).",
    "prefix_reps": "Timed repetitions of each prefix-cache path per turn (after one warm-up).",
    "bandwidth": "Bandwidth the step's bytes bound (step_bound_s, step_efficiency) divides "
                 "by: probe (measured in this run, after its decode steps) or calibration "
                 "(this machine's `kvbench calibrate`).",
    "prefill": "Shared prefill: a file to replay this run's prefill from (refused unless "
               "recorded with the same model, weights, layers, dtype, device, batch and "
               "prompt tokens) or, when it does not exist, to record this run's own prefill "
               "into; a directory: the file for this run inside it. Replayed runs waive "
               "ttft.",
}


def make_command(cls: type[Strategy]) -> Callable[..., None]:
    """A typer command for `cls`: shared run options, the strategy's parameters, --out."""
    from kvbench.options import config_command

    def run(cfg: RunConfig, sparams: Any, out: Path | None) -> None:
        from kvbench.console import wrote

        wrote(execute(cls, sparams, cfg, out))

    return config_command([(RunConfig, _HELP), (cls.params, None)], run, cls.summary())


def execute(cls: type[Strategy], sparams: Any, cfg: RunConfig, out: Path | None) -> Path:
    """Run `cls` (kvbench.runtime.engine.run) with a loading status, notes, a progress bar
    and SIGTERM/SIGINT stopping after the step in progress; store the records, print the
    summary; returns the result file (a run stopped early: exit 128 + the signal)."""
    from rich.progress import Progress

    from kvbench.console import err_console
    from kvbench.envinfo import collect_env
    from kvbench.runtime.engine import Hooks, run
    from kvbench.store import ResultWriter, default_out_path

    colour = {"note": "cyan", "warning": "yellow"}
    stop = Interrupts()
    with contextlib.ExitStack() as live:
        def progress(what: str, total: int) -> Callable[[], None]:
            # the decode steps only: a signal stops them after the one in progress
            live.enter_context(stop)
            bar = live.enter_context(Progress(console=err_console, transient=True))
            err_console.print(f"decoding {total} steps (SIGTERM or Ctrl-C: stop after the "
                              "current step and store the records so far, marked partial)")
            task = bar.add_task(what, total=total)
            return lambda: bar.advance(task)

        result = run(cls, sparams, cfg, Hooks(
            status=err_console.status,
            say=lambda kind, text: err_console.print(f"[{colour[kind]}]{kind}:[/] {text}"),
            progress=progress,
            stop=lambda: None if stop.signum is None else signal.Signals(stop.signum).name))
    path = out or default_out_path(f"run-{cls.name}")
    with ResultWriter(path, collect_env()) as w:
        w.write_all(result.records)
    summary(result.records, result.params, result.fit, result.accuracy)
    if result.prefix_turns:
        from kvbench.prefix.render import turn_table

        turn_table(result.records)
    if result.interrupted:
        err_console.print(f"kvbench: {result.interrupted}; partial records in {path}")
        raise typer.Exit(128 + (stop.signum or 0))
    return path


class Interrupts:
    """While entered, SIGTERM and SIGINT only note their number (`signum`): the decode loop
    stops after the step in progress and the run stores what it measured, marked partial."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def _note(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # asked twice: stop now
            signal.signal(signum, self._old[signum])
            signal.raise_signal(signum)
        self.signum = signum

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():  # where handlers may go
            self._old = {s: signal.signal(s, self._note) for s in (signal.SIGTERM,
                                                                    signal.SIGINT)}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)


def summary(recs: list[Record], params: dict, fit: dict, accuracy: str) -> None:
    """The end-of-run table: every non-trace metric, its value and spread."""
    from rich.table import Table

    from kvbench.console import console, value_text
    from kvbench.units import format_bytes

    t = Table(title=f"{recs[0].name} on {params['model']} ({params['layers']}/"
              f"{params['layers_total']} layers, {params['weights']} weights, batch "
              f"{params['batch']}, {params['dtype']}, {params['accel']})")
    for col in ("metric", "where", "value"):
        t.add_column(col)
    for r in recs:
        if r.metric.startswith(("trace.", "prefix_")):  # prefix_: their own table
            continue
        where = str(r.params.get("where", ""))
        if r.status != "ok":
            t.add_row(r.metric, where, f"[yellow]{r.status}[/] {r.reason}")
        elif r.unit == "B":
            t.add_row(r.metric, where, format_bytes(r.value))
        else:
            t.add_row(r.metric, where, value_text(r.value, r.unit, r.stats))
    console.print(t)
    from kvbench.runtime.bound import describe

    if line := describe(recs):
        console.print(line)
    console.print(f"estimated: weights {format_bytes(fit['weight_bytes'])}, KV "
                  f"{format_bytes(fit['kv_bytes'])}" + (f"; {accuracy}" if accuracy else ""))

