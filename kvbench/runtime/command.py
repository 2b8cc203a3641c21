"""`kvbench run STRATEGY`: one typer command per registered strategy, built from the registry.

Each command has the shared run options (RunConfig fields) followed by the strategy's own
parameters (fields of its `params` dataclass, help from the field's "help" metadata) and
`--out`. `execute` is the whole run: validate, refuse what cannot fit, load, warm up, run
with a progress bar, store the records, optionally time transformers' `generate` on the
same prompt side by side (`--compare-hf`), and print a summary table.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from kvbench.errors import KvbenchError, require
from kvbench.runtime.run import RunConfig
from kvbench.schema import Record, measured, not_measured
from kvbench.strategies import Strategy, supports_append
from kvbench.timing import GC_OFF, gc_off

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
}


def make_command(cls: type[Strategy]) -> Callable[..., None]:
    """A typer command for `cls`: shared run options, the strategy's parameters, --out."""
    from kvbench.options import config_command

    def run(cfg: RunConfig, sparams: Any, out: Path | None) -> None:
        from kvbench.console import wrote

        wrote(execute(cls, sparams, cfg, out))

    return config_command([(RunConfig, _HELP), (cls.params, None)], run, cls.summary())


def execute(cls: type[Strategy], sparams: Any, cfg: RunConfig, out: Path | None) -> Path:
    """Run `cls` on the configured model and store its records; returns the result file."""
    import torch
    from rich.progress import Progress

    from kvbench.console import err_console
    from kvbench.envinfo import collect_env
    from kvbench.kernels.attention import backend_use
    from kvbench.models.weights import load
    from kvbench.runtime.context import Counters, RunContext
    from kvbench.runtime.run import (
        check_fit,
        decode_run,
        peak_memory,
        read_text,
        records,
        resolve,
        run_params,
        token_rows,
    )
    from kvbench.store import ResultWriter, default_out_path

    require(cfg.turns <= 1 or supports_append(cls), f"--turns {cfg.turns}: strategy "
            f"'{cls.name}' has no append (multi-turn); it runs single-turn only")
    require(cfg.threads >= 0, f"--threads {cfg.threads}: 0 (torch's default) or more")
    spec, layers, device, dtype, weights = resolve(cfg)
    from kvbench.runtime.machine import machine_defaults
    from kvbench.runtime.shadow import Shadow

    layers, notes = machine_defaults(spec, cfg.layers, layers, device, weights, dtype.itemsize,
                                     cfg.prompt_len, cfg.gen_len)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cuda = device.type == "cuda"
    from kvbench.runtime import bound, opcount

    bw = bound.stored(cuda) if cfg.bandwidth == "calibration" else None
    sparams, warnings = cls.for_run(sparams, cfg.seq_len)
    fit = check_fit(spec, layers, cfg, cls, sparams, device, dtype)
    text = read_text(cfg.text)
    cache = None
    if cfg.prefix_cache:
        from kvbench.prefix.turns import PrefixTurns, open_cache, tier_info

        cache = open_cache(cfg, cls, spec, layers, dtype, device)
    with err_console.status(f"loading {spec.name} ({weights} weights, {layers} layers)"):
        loaded = load(spec, weights, layers, dtype, device, cfg.seed)
    p, g, turns, length = cfg.prompt_len, cfg.gen_len, cfg.turns, cfg.seq_len
    if cfg.mode == "passkey":
        from kvbench.runtime import passkey

        rows, answers, _ = passkey.build(loaded.encode, cfg.batch, p, cfg.depth, cfg.seed,
                                         spec.vocab, cfg.task)
        need = max(len(a) for a in answers)
        require(g + 1 >= need, f"--gen-len {g}: the {cfg.task} answers take up to {need} "
                f"tokens; pass --gen-len {need - 1} or more")
        rows = rows.to(device)
    else:
        rows = token_rows(loaded.encode(text), cfg.batch, length if cfg.mode == "eval" else
                          turns * p, spec.vocab,
                          f"--text '{cfg.text}'" if cfg.text else "the default text").to(device)
    mode = "generate" if cfg.mode == "passkey" else cfg.mode
    model = loaded.model

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def start(max_len: int, shadow: bool = True) -> Strategy:
        counters = Counters(spec.n_kv_heads, dtype.itemsize, cuda, layers)
        ctx = RunContext(spec, layers, cfg.batch, max_len, dtype, device,
                         torch.device("cpu"), counters, model)
        strategy = cls(sparams, ctx)
        # per-layer error against full attention on the same inputs (nil for full itself)
        if shadow and cfg.mode == "eval" and cls.name != "full":
            strategy = Shadow(strategy, ctx)
        model.setup(strategy, counters, max_len)
        return strategy

    # untimed warm-up (one-time allocations, kernel selection) on a cache of the real run's
    # size, since strategies check their geometry (windows, blocks) against it
    warm = min(p, 16)
    decode_run(model, start(length), rows[:, :turns * warm], min(g, 2), "generate", sync,
               turns=turns)
    model.strategy = None  # release the warm-up cache before the timed run allocates its own
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    strategy = start(length)
    for note in notes:  # once every input is known to be valid (bad input: one line)
        err_console.print(f"[cyan]note:[/] {note}")
    for warning in warnings:
        err_console.print(f"[yellow]warning:[/] {warning}")
    backend_use(reset=True)
    turns_hook = None
    if cache is not None:
        turns_hook = PrefixTurns(cache, model, lambda: start(length, shadow=False),
                                 lambda: model.setup(strategy, strategy.ctx.counters, length),
                                 sync, cfg.prefix_reps, p, g)
    from kvbench.runtime.energy import Meter

    meter = Meter(cuda=cuda)
    meter.start()
    with Interrupts() as stop, Progress(console=err_console, transient=True) as bar, gc_off():
        err_console.print(f"decoding {turns * g} steps (SIGTERM or Ctrl-C: stop after the "
                          "current step and store the records so far, marked partial)")
        task = bar.add_task(f"{cls.name}: decode", total=turns * g)
        outcome = decode_run(model, strategy, rows, g, mode, sync,
                             lambda: bar.advance(task) or stop.signum is not None, turns,
                             turns_hook.between if turns_hook else None)
    sync()
    meter.stop()
    backend = backend_use(reset=True)  # attention backend per phase of the timed run
    shadowed = isinstance(strategy, Shadow)
    if shadowed:  # the last step's reference attention (outside the timed region)
        strategy.flush()
    params = run_params(cfg, spec, layers, device, dtype, weights, sparams)
    if stop.signum is not None:  # partial: label every record with the steps completed
        params["steps_completed"] = len(outcome.steps)
    accuracy = "random weights: accuracy metrics are off" if weights == "random" else ""
    recs = list(records(cls.name, params, outcome, cfg.batch, accuracy, model.counters,
                        peak_memory(), shadowed))
    # after the records above (peak memory read): one untimed step counted, then the
    # bandwidth probe
    counted = "interrupted: no step after the timed ones" if stop.signum is not None else \
        opcount.count_step(model, strategy, outcome.tokens, sync)
    recs += opcount.records(cls.name, params, counted, model.counters.step)
    if bw is None:
        try:
            bw = bound.probe(cuda, torch.get_num_threads())
        except KvbenchError as e:
            bw = f"bandwidth probe: {e}"
    recs += bound.records(cls.name, params, outcome.steps, model.counters.graph, bw)
    recs += [measured("run", cls.name, "kv_alloc_bytes", "B", "lower", [fit[f"{w}_bytes"]],
                      {**params, "where": w}, {"statistic": "exact", "per": "run", "source":
                      "Strategy.placement: the KV and state the strategy allocates per "
                      "device (its allocation plan, counted, not sampled)"})
             for w in ("accel", "host")]
    recs += meter.records(cls.name, params, cfg.batch * (len(outcome.steps) + turns))
    if cfg.mode == "passkey":
        recs += passkey.records(cls.name, params, outcome.tokens, answers, p, accuracy)
    if turns_hook is not None:
        recs += turns_hook.records(cls.name, params, tier_info(cache))
        cache.close()
    if cfg.compare_hf and stop.signum is None:
        def again() -> list[float]:  # one more greedy decode of ours, for interleaving
            with gc_off():
                return decode_run(model, start(length), rows[:, :p], g, "generate",
                                  sync).steps

        recs += compare_hf(cls.name, params, loaded.hf_model, rows[:, :p], outcome, again,
                           device, sync)
    if stop.signum is not None:
        why = (f"interrupted by {signal.Signals(stop.signum).name} after "
               f"{len(outcome.steps)} of {turns * g} decode steps")
        for rec in recs:
            rec.method["partial"] = why
    path = out or default_out_path(f"run-{cls.name}")
    with ResultWriter(path, collect_env()) as w:
        for rec in recs:
            rec.version = cls.version
            rec.method.setdefault("backend", backend)
            w.write(rec)
    summary(recs, params, fit, accuracy)
    if turns_hook is not None:
        from kvbench.prefix.render import turn_table

        turn_table(recs)
    if stop.signum is not None:
        err_console.print(f"kvbench: {why}; partial records in {path}")
        raise typer.Exit(128 + stop.signum)
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


def compare_hf(name: str, params: dict, hf: Any, prompt: Any, ours: Any,
               again: Callable[[], list[float]], device: Any, sync: Callable[[], None],
               rounds: int = 3) -> list[Record]:
    """transformers' greedy `generate` on the same prompt [B, P], dtype and threads.

    A logits processor stamps every step of generate after a device synchronise (it runs
    once per forward, any batch), so HF's per-step decode times are taken like ours. Ours
    and transformers' alternate for `rounds` rounds (ours' first round is the run itself)
    and the bar compares the medians of all per-step rates: robust to a shared machine.
    """
    import statistics
    from itertools import pairwise

    import torch

    if hf is None:
        return [not_measured("run", name, "hf_decode_tokens_per_s", "waived",
                             "random weights: no transformers model to compare with", params)]
    hf.to(device)
    b, g = prompt.shape[0], len(ours.steps)

    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamps(LogitsProcessor):  # called once per step, after that step's forward
        def __init__(self) -> None:
            self.ns: list[int] = []

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            sync()
            self.ns.append(time.perf_counter_ns())
            return scores

    def gen(n: int) -> tuple[list[float], Any]:
        stamps = Stamps()
        with gc_off():  # as for ours
            seq = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                              logits_processor=LogitsProcessorList([stamps]))
        return [(t1 - t0) * 1e-9 for t0, t1 in pairwise(stamps.ns)], seq

    gen(3)  # warm-up
    ours_steps, steps = list(ours.steps), []
    for r in range(rounds):
        if r:
            ours_steps += again()
        hf_steps, seq = gen(g + 1)  # stamp #0 follows the prefill, then one per step
        steps += hf_steps
    method = {"timer": "perf_counter_ns", "gc": GC_OFF, "warmup": 1, "reps": len(steps),
              "rounds": rounds,
              "statistic": "median", "per": "batch / decode step time (logits-processor stamps)"}
    hf_rec = measured("run", name, "hf_decode_tokens_per_s", "tokens/s", "higher",
                      [b / s for s in steps], params, method)
    ours_rate = statistics.median(b / s for s in ours_steps)
    p = prompt.shape[1]
    agree = float((seq[:, p:] == ours.tokens[:, p:p + g + 1]).float().mean())
    ratio = measured("run", name, "decode_speed_vs_hf", "x", "higher",
                     [ours_rate / hf_rec.value], params,
                     {**method, "statistic": "median ours / median transformers",
                      "greedy_token_agreement": agree if params["mode"] == "generate"
                      else None})
    return [hf_rec, ratio]


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

