"""The engine under `kvbench run`: one strategy run as a library call, no typer, no printing.

`run(cls, params, config) -> RunResult` validates, refuses what cannot fit, loads the model,
warms up, decodes (kvbench.runtime.run.decode_run), and returns every record of the run:
timings, counters, the bytes bound, energy, passkey, prefix-cache turns and the comparison
with transformers' `generate`, each stamped with the strategy's version and the attention
backend. What a caller shows while it runs (the loading status, notes, warnings, progress)
and when it stops early go through `Hooks`; the CLI (kvbench.runtime.command.execute) gives
rich ones and writes the records, a library caller may give none. As vLLM's
`benchmarks/latency.py::main(args)`, the command and any sweep call the same function.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvbench.errors import KvbenchError, require
from kvbench.runtime import prefill
from kvbench.runtime.run import RunConfig
from kvbench.schema import Record, measured, not_measured
from kvbench.strategies import Strategy, supports_append
from kvbench.timing import GC_OFF, gc_off


@dataclass(frozen=True)
class Hooks:
    """What a caller sees of a run: `status(text)` a context around loading, `say(kind,
    text)` a note or warning once every input is known valid, `progress(total)` a callable
    advanced after each decode step, and `stop()` the reason to stop after the step in
    progress (e.g. "SIGTERM"), or None to go on. The defaults show nothing and never stop."""

    status: Callable[[str], contextlib.AbstractContextManager[Any]] = \
        lambda text: contextlib.nullcontext()
    say: Callable[[str, str], None] = lambda kind, text: None
    progress: Callable[[str, int], Callable[[], None]] = lambda what, total: lambda: None
    stop: Callable[[], str | None] = lambda: None


@dataclass
class RunResult:
    """A run's records (in writing order) and what its summary shows: the run's parameters,
    the memory estimate (kvbench.runtime.run.check_fit), the accuracy note, and, for a run
    stopped early, why (every record then says so in method.partial)."""

    records: list[Record]
    params: dict[str, Any]
    fit: dict[str, Any]
    accuracy: str = ""
    interrupted: str = ""
    prefix_turns: bool = False


def run(cls: type[Strategy], sparams: Any, cfg: RunConfig, hooks: Hooks = Hooks()
        ) -> RunResult:
    """Run `cls` with `sparams` as `cfg` says and return its records (nothing written)."""
    import torch

    from kvbench.kernels.attention import backend_use
    from kvbench.kernels.cpu import cold_kv
    from kvbench.models.weights import load
    from kvbench.runtime import bound, opcount
    from kvbench.runtime.context import Counters, RunContext
    from kvbench.runtime.energy import Meter
    from kvbench.runtime.machine import machine_defaults
    from kvbench.runtime.run import (
        check_fit,
        decode_run,
        past_context,
        peak_memory,
        read_text,
        records,
        resolve,
        run_params,
    )
    from kvbench.runtime.shadow import Shadow

    require(cfg.turns <= 1 or supports_append(cls), f"--turns {cfg.turns}: strategy "
            f"'{cls.name}' has no append (multi-turn); it runs single-turn only")
    require(cfg.threads >= 0, f"--threads {cfg.threads}: 0 (torch's default) or more")
    spec, layers, device, dtype, weights = resolve(cfg)
    layers, notes = machine_defaults(spec, cfg.layers, layers, device, weights, dtype.itemsize,
                                     cfg.prompt_len, cfg.gen_len)
    past = past_context(cfg, spec)
    notes += [past] if past else []
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cuda = device.type == "cuda"
    bw = bound.stored(cuda) if cfg.bandwidth == "calibration" else None
    sparams, warnings = cls.for_run(sparams, cfg.seq_len)
    fit = check_fit(spec, layers, cfg, cls, sparams, device, dtype)
    text = read_text(cfg.text)
    cache = None
    if cfg.prefix_cache:
        from kvbench.prefix.turns import PrefixTurns, open_cache, tier_info

        cache = open_cache(cfg, cls, spec, layers, dtype, device)
    with hooks.status(f"loading {spec.name} ({weights} weights, {layers} layers)"):
        loaded = load(spec, weights, layers, dtype, device, cfg.seed)
    p, g, turns, length = cfg.prompt_len, cfg.gen_len, cfg.turns, cfg.seq_len
    rows, answers = _rows(cfg, loaded, text, spec.vocab)
    rows = rows.to(device)
    replay, recorder, shared = _prefill(cfg, spec, layers, dtype, device, weights, rows[:, :p])
    mode = "generate" if cfg.mode == "passkey" else cfg.mode
    model = loaded.model

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def start(max_len: int, shadow: bool = True) -> Strategy:
        counters = Counters(spec.n_kv_heads, dtype.itemsize, cuda, layers, cls.metrics)
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
    decode_run(model, start(length), rows[:, :turns * min(p, 16)], min(g, 2), "generate",
               sync, turns=turns)
    model.strategy = None  # release the warm-up cache before the timed run allocates its own
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    strategy = start(length)
    for note in notes:  # once every input is known to be valid (bad input: one line)
        hooks.say("note", note)
    for warning in warnings:
        hooks.say("warning", warning)
    backend_use(reset=True)
    turns_hook = None
    if cache is not None:
        turns_hook = PrefixTurns(cache, model, lambda: start(length, shadow=False),
                                 lambda: model.setup(strategy, strategy.ctx.counters, length),
                                 sync, cfg.prefix_reps, p, g)
    meter = Meter(cuda=cuda)
    meter.start()
    stopped: list[str] = []

    def step() -> bool:
        advance()
        if (why := hooks.stop()) is not None:
            stopped.append(why)
        return bool(stopped)

    with gc_off(), cold_kv():
        advance = hooks.progress(f"{cls.name}: decode", turns * g)
        model.recorder = recorder
        outcome = decode_run(model, strategy, rows, g, mode, sync, step, turns,
                             turns_hook.between if turns_hook else None, replay)
        model.recorder = None
    sync()
    meter.stop()
    backend = backend_use(reset=True)  # attention backend per phase of the timed run
    shadowed = isinstance(strategy, Shadow)
    if shadowed:  # the last step's reference attention (outside the timed region)
        strategy.flush()
    params = run_params(cfg, spec, layers, device, dtype, weights, sparams)
    if stopped:  # partial: label every record with the steps completed
        params["steps_completed"] = len(outcome.steps)
    accuracy = "random weights: accuracy metrics are off" if weights == "random" else ""
    recs = list(records(cls.name, params, outcome, cfg.batch, accuracy, model.counters,
                        peak_memory(), shadowed))
    # after the records above (peak memory read): one untimed step counted, then the
    # bandwidth probe
    counted = "interrupted: no step after the timed ones" if stopped else \
        opcount.count_step(model, strategy, outcome.tokens, sync)
    recs += opcount.records(cls.name, params, counted, model.counters.step, cls.host_reads)
    per = bound.per_step(model.counters.graph, len(outcome.steps))
    if bw is None:
        try:
            bw = bound.probe_bounding(cuda, torch.get_num_threads(), outcome.steps, per)
        except KvbenchError as e:
            bw = f"bandwidth probe: {e}"
    recs += bound.records(cls.name, params, outcome.steps, per, bw)
    recs += [measured("run", cls.name, "kv_alloc_bytes", "B", "lower", [fit[f"{w}_bytes"]],
                      {**params, "where": w}, {"statistic": "exact", "per": "run", "source":
                      "Strategy.placement: the KV and state the strategy allocates per "
                      "device (its allocation plan, counted, not sampled)"})
             for w in ("accel", "host")]
    recs += meter.records(cls.name, params, cfg.batch * (len(outcome.steps) + turns))
    if cfg.mode == "passkey":
        from kvbench.runtime import passkey

        recs += passkey.records(cls.name, params, outcome.tokens, answers, p, accuracy)
    if turns_hook is not None:
        recs += turns_hook.records(cls.name, params, tier_info(cache))
        cache.close()
    if cfg.compare_hf and not stopped:
        def again() -> list[float]:  # one more greedy decode of ours, for interleaving
            with gc_off(), cold_kv():
                return decode_run(model, start(length), rows[:, :p], g, "generate",
                                  sync, replay=replay).steps

        recs += compare_hf(cls.name, params, loaded.hf_model, rows[:, :p], outcome, again,
                           device, sync)
    if recorder is not None:
        recorder.save(shared[0], shared[1], rows[:, :p], f"kvbench run {cls.name} "
                      f"({time.strftime('%Y-%m-%dT%H:%M:%S%z')})")
    if replay is not None:  # its prefill was not this run's: not timed, no energy of it
        recs = [_untimed_prefill(r, replay) for r in recs]
    why = (f"interrupted by {stopped[0]} after {len(outcome.steps)} of {turns * g} decode "
           "steps") if stopped else ""
    for rec in recs:
        rec.version = cls.version
        rec.method.setdefault("backend", backend)
        rec.method.update(prefill.method(replay, shared[0] if shared else None))
        if past:
            rec.method["context"] = past
        if why:
            rec.method["partial"] = why
    return RunResult(recs, params, fit, accuracy, why, turns_hook is not None)


def _prefill(cfg: RunConfig, spec: Any, layers: int, dtype: Any, device: Any, weights: str,
             prompt: Any) -> tuple[Any, Any, tuple[Any, dict] | None]:
    """`--prefill`: (the replay to decode from, or the recorder of this run's own prefill,
    and (file, fields)); (None, None, None) without it."""
    if not cfg.prefill:
        return None, None, None
    require(cfg.turns == 1 and not cfg.prefix_cache, "--prefill: single-turn runs without "
            "--prefix-cache only (it replaces the first prompt's prefill)")
    meta = {"model": spec.name, "weights": weights, "layers": layers,
            "seed": cfg.seed if weights == "random" else None,
            "dtype": str(dtype).removeprefix("torch."), "accel": device.type,
            "batch": cfg.batch, "prompt_len": cfg.prompt_len}
    path = prefill.file_for(cfg.prefill, meta, prompt)
    if path.exists():
        return prefill.load(path, meta, prompt, device), None, (path, meta)
    return None, prefill.Recorder(), (path, meta)


def _untimed_prefill(rec: Record, replay: Any) -> Record:
    """A replayed run's record of its prefill's time or energy, and its host peak (the
    file's mapped pages count in the resident set), waived; others as they are."""
    why = f"prefill replayed from {replay.path}, not run here"
    if rec.metric == "peak_memory" and rec.params.get("where") == "host":
        return not_measured(rec.kind, rec.name, rec.metric, "waived", f"{why}: the peak "
                            "resident set holds the file's mapped pages", rec.params)
    if rec.metric in ("ttft", "energy_per_token") or (
            rec.metric.startswith("trace.") and rec.unit == "s"
            and rec.params.get("phase") == "prefill"):
        return not_measured(rec.kind, rec.name, rec.metric, "waived", why, rec.params)
    return rec


def _rows(cfg: RunConfig, loaded: Any, text: str, vocab: int) -> tuple[Any, list[Any]]:
    """The token rows a run feeds ([B, turns * P], eval: the whole sequences) and, in
    passkey mode, the answers its generated tokens are scored against."""
    from kvbench.runtime.run import token_rows

    p, g, turns = cfg.prompt_len, cfg.gen_len, cfg.turns
    if cfg.mode == "passkey":
        from kvbench.runtime import passkey

        rows, answers, _ = passkey.build(loaded.encode, cfg.batch, p, cfg.depth, cfg.seed,
                                         vocab, cfg.task)
        need = max(len(a) for a in answers)
        require(g + 1 >= need, f"--gen-len {g}: the {cfg.task} answers take up to {need} "
                f"tokens; pass --gen-len {need - 1} or more")
        return rows, answers
    return token_rows(loaded.encode(text), cfg.batch, cfg.seq_len if cfg.mode == "eval" else
                      turns * p, vocab,
                      f"--text '{cfg.text}'" if cfg.text else "the default text"), []


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
