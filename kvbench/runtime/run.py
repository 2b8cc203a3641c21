"""The run: load a model, check it fits, prefill, decode step by step under one strategy.

Modes (issue: model runtime): "generate" feeds back the greedy token; "eval" is teacher
forced (HGCA Table 1 method): the prompt is the first P tokens of the text, each decode
step feeds the true next token, and the log-likelihood of tokens P..P+G (G+1 predictions:
the prefill's last logits, then one per decode step) gives the perplexity.
Batch row b reads its own window of the text (windows overlap only when the text is short).

Multi-turn (`turns` > 1, HGCA Alg. 1 lines 19-21): the sequence is `turns` blocks of
P + G + 1 tokens, P prompt tokens then G + 1 generated (the last one scored, not fed).
Turn 0 is the run above; turn k >= 1 appends the previous turn's last token and the next
P prompt tokens (one `Strategy.append` of P + 1 tokens, timed as that turn's append TTFT,
its last logits scored) and decodes G more. Eval mode reads the whole sequence from the
text and scores 1 + G predictions per turn; generate mode takes turn k's prompt from the
text's tokens kP..(k+1)P and generates the rest. Appends are step 0 of the trace (all
prompt processing), decode steps are numbered 1..turns * G.
"""

from __future__ import annotations

import math
import os
import resource
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvbench import paths
from kvbench.errors import KvbenchError, require
from kvbench.kernels.cpu import greedy
from kvbench.models import ModelSpec, get_spec
from kvbench.schema import ParamValue, Record, measured, not_measured
from kvbench.strategies import Strategy
from kvbench.timing import GC_OFF
from kvbench.units import dtype_name, format_bytes

MODES = ("generate", "eval", "passkey")
DEFAULT_TEXT_DIR = Path("/usr/share/common-licenses")


@dataclass(frozen=True)
class RunConfig:
    """Options every `kvbench run STRATEGY` shares; suites build it from TOML by name."""

    model: str = "smollm2-135m"
    weights: str = "auto"  # auto: bundled for smollm2-135m, random otherwise
    layers: int = 0  # 0: all
    batch: int = 1
    prompt_len: int = 256
    gen_len: int = 32
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    device: str = "auto"  # auto: cuda when present, else cpu
    mode: str = "generate"
    text: str = ""  # default: /usr/share/common-licenses/* concatenated
    threads: int = 0  # 0: torch's default
    seed: int = 0
    compare_hf: bool = False
    turns: int = 1
    depth: float = 0.5  # passkey mode: where the key sits in the prompt (0 start, 1 end)
    task: str = "passkey"  # passkey mode: kvbench.runtime.passkey.TASKS
    prefix_cache: str = ""  # kvbench.prefix: accel, host:N or disk:PATH ("": none)
    prefix_capacity: str = "0"  # bytes of the tier (0: twice the run's largest save)
    prefix_chunk: int = 16  # tokens per hashed chunk (vLLM's block size)
    prefix_reps: int = 3  # timed repetitions of each path per turn
    bandwidth: str = "probe"  # of the step bound: kvbench.runtime.bound.SOURCES
    prefill: str = ""  # shared prefill file or directory (kvbench.runtime.prefill)

    @property
    def seq_len(self) -> int:
        """Tokens of the whole sequence: turns * (P + G + 1) (the cache's max length)."""
        return self.turns * (self.prompt_len + self.gen_len + 1)


def read_text(path: str) -> str:
    """The evaluation text: a file (UTF-8 text, else KvbenchError naming it), or the system
    license texts concatenated."""
    if path:
        found = paths.stat(path, "--text")
        require(found is not None and stat.S_ISREG(found.st_mode),
                f"--text '{paths.shown(path)}' is not a readable file")
        try:
            return Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise KvbenchError(f"--text '{paths.shown(path)}' is not UTF-8 text (byte "
                               f"{e.start}: {e.reason})") from None
        except OSError as e:
            raise KvbenchError(f"--text '{paths.shown(path)}': {e.strerror or e}") from None
    files = sorted(f for f in DEFAULT_TEXT_DIR.glob("*") if f.is_file())
    require(bool(files), f"no default text in {DEFAULT_TEXT_DIR}; pass --text PATH")
    return "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def resolve(cfg: RunConfig) -> tuple[ModelSpec, int, Any, Any, str]:
    """Validate options: (spec, layers, torch device, torch dtype, weights source)."""
    import torch

    spec = get_spec(cfg.model)
    layers = cfg.layers or spec.n_layers
    require(1 <= layers <= spec.n_layers, f"--layers {cfg.layers}: {spec.name} has "
            f"{spec.n_layers} layers")
    require(cfg.batch >= 1 and cfg.prompt_len >= 1 and cfg.gen_len >= 1 and cfg.turns >= 1,
            "--batch, --prompt-len, --gen-len and --turns must be at least 1")
    turns = f" x {cfg.turns} turns" if cfg.turns > 1 else ""
    weights = cfg.weights if cfg.weights != "auto" else (
        "bundled" if spec.name == "smollm2-135m" else "random")
    # a checkpoint's context is what it was trained on; random weights (speed only) of a
    # rotary family take any length (past_context says so in every record); learned
    # positions (opt) end at the table's last row
    require(cfg.seq_len <= spec.ctx or (weights == "random" and spec.family != "opt"),
            f"(prompt {cfg.prompt_len} + {cfg.gen_len} generated tokens + 1){turns} exceeds "
            f"{spec.name}'s context of {spec.ctx}" + (
                "" if spec.family == "opt" else " (random weights, for speed only, may go "
                "past it)"))
    require(cfg.turns == 1 or not cfg.compare_hf,
            "--compare-hf times single-turn generation; pass --turns 1")
    require(cfg.mode in MODES, f"--mode '{cfg.mode}': one of {', '.join(MODES)}")
    require(cfg.mode != "passkey" or (cfg.turns == 1 and not cfg.compare_hf),
            "--mode passkey is single-turn, without --compare-hf")
    require(0 <= cfg.depth <= 1, f"--depth {cfg.depth}: must be in [0, 1]")
    from kvbench.runtime.passkey import TASKS

    require(cfg.task in TASKS, f"--task '{cfg.task}': one of {', '.join(TASKS)}")
    require(cfg.task == "passkey" or cfg.mode == "passkey",
            f"--task {cfg.task} is a retrieval task: pass --mode passkey")
    from kvbench.runtime.bound import SOURCES

    require(cfg.bandwidth in SOURCES, f"--bandwidth '{cfg.bandwidth}': {' or '.join(SOURCES)}")
    require(cfg.device in ("auto", "cpu", "cuda"), f"--device '{cfg.device}': auto, cpu, cuda")
    if cfg.device == "cuda":
        require(torch.cuda.is_available(), "--device cuda: no CUDA GPU on this machine")
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    name = dtype_name(cfg.dtype) if cfg.dtype != "auto" else ("bfloat16" if cuda else "float32")
    return spec, layers, device, getattr(torch, name), weights


def past_context(cfg: RunConfig, spec: ModelSpec) -> str:
    """What a random-weights run past the model's trained context says ("" within it;
    `resolve` refuses every other run past it)."""
    if cfg.seq_len <= spec.ctx:
        return ""
    return (f"{cfg.seq_len} tokens, past {spec.name}'s trained context of {spec.ctx}: random "
            "weights with RoPE positions extended (the shape's speed; no accuracy)")


def check_fit(spec: ModelSpec, layers: int, cfg: RunConfig, cls: type[Strategy],
              sparams: Any, device: Any, dtype: Any) -> dict[str, int]:
    """Estimate weight bytes and what the strategy allocates per device (its
    `placement`: KV and the state beside it) and refuse a run that cannot fit. Pinned host
    buffers are allocated at their exact size (strategies._hostcopy.HostKV, GPU audit
    finding 3), so "host" is what a CUDA run really page-locks and holds; "pinned_bytes" is
    the page-locked part (0 off CUDA)."""
    import psutil
    import torch

    from kvbench.runtime.context import Counters, RunContext

    elem = dtype.itemsize
    weights = spec.params(layers) * elem
    tokens = cfg.seq_len - 1  # the last token is scored, never cached
    kv = cfg.batch * tokens * spec.kv_bytes_per_token(elem, layers)
    ctx = RunContext(spec, layers, cfg.batch, cfg.seq_len, dtype, device, torch.device("cpu"),
                     Counters(spec.n_kv_heads, elem))
    need = cls.placement(sparams, ctx)
    host_free = psutil.virtual_memory().available
    if device.type == "cuda":
        accel_free = torch.cuda.mem_get_info(device)[0]
        checks = [("accel", need["accel"] + weights, accel_free),
                  ("host", need["host"], host_free)]
    else:
        checks = [("accel", need["accel"] + need["host"] + weights, host_free)]
    for where, n, free in checks:
        if n > free:
            raise KvbenchError(
                f"batch {cfg.batch} x {tokens} tokens does not fit: "
                f"{format_bytes(n)} ({format_bytes(kv)} KV, {format_bytes(weights)} weights) "
                f"on {where} ({device.type if where == 'accel' else 'cpu'}), "
                f"{format_bytes(free)} available")
    return {"weight_bytes": weights, "kv_bytes": kv, "accel_bytes": need["accel"],
            "host_bytes": need["host"], "pinned_bytes": need.get("pinned", 0)}


def token_rows(ids: list[int], batch: int, need: int, vocab: int,
               source: str = "the text") -> Any:
    """[batch, need] windows of the token stream; KvbenchError naming `source` if the
    text is too short."""
    import torch

    require(len(ids) >= need, f"prompt + generated tokens ({need}) longer than {source} "
            f"({len(ids)} tokens); pass a longer --text or a shorter --prompt-len")
    stride = (len(ids) - need) // max(batch - 1, 1)
    t = torch.tensor(ids, dtype=torch.long) % vocab
    return torch.stack([t[b * stride:b * stride + need] for b in range(batch)])


@dataclass
class Outcome:
    """What one run measured: per-step seconds, first-token seconds, NLL per scored token."""

    ttft: float
    appends: list[float]  # append TTFT of turns 1.. (empty for a single turn)
    steps: list[float]  # decode steps of every turn, in order
    nll: list[float]
    tokens: Any  # [B, turns * (P + G + 1)] generated or teacher-forced sequence


def decode_run(model: Any, strategy: Strategy, rows: Any, gen_len: int, mode: str,
               sync: Callable[[], None], on_step: Callable[[], bool | None] = lambda: None,
               turns: int = 1, between: Callable[[int, Any, Strategy], None] | None = None,
               replay: Any = None) -> Outcome:
    """`turns` turns of (prompt, gen_len decode steps) as the module describes.

    `on_step` runs after every decode step; when it returns True the run stops there (an
    interrupt) and the outcome holds the steps completed so far. `between(turn, seq,
    strategy)` runs before each later turn's prompt, outside the timed region (the prefix
    cache's save and its TTFT paths, kvbench.prefix.turns). `replay`: a shared prefill
    (kvbench.runtime.prefill.Replay) replayed in place of the first prompt's forward; a
    model with a `recorder` records its own prefill into it.

    rows [B, turns * P] (generate: each turn's prompt) or [B, turns * (P + G + 1)] (eval:
    the whole sequence).
    """
    import torch
    import torch.nn.functional as F

    counters = model.counters
    b, block = rows.shape[0], rows.shape[1] // turns
    p = block - (gen_len + 1 if mode == "eval" else 0)
    n = p + gen_len + 1  # tokens per turn
    if mode == "eval":
        seq = rows.clone()
    else:
        seq = rows.new_zeros(b, turns * n)
        seq.view(b, turns, n)[:, :, :p] = rows.reshape(b, turns, p)
    nll: list[float] = []

    def score(logits: torch.Tensor, pos: int) -> None:
        if mode == "eval":
            nll.extend(F.cross_entropy(logits, seq[:, pos], reduction="none").tolist())
        else:
            seq[:, pos] = greedy(logits)

    firsts, steps = [], []
    for turn in range(turns):
        base = turn * n
        start = max(base - 1, 0)  # a later turn also feeds the last turn's unfed token
        if turn and between is not None:
            between(turn, seq, strategy)
        counters.step = 0
        strategy.begin_step(0)
        sync()
        counters.step_begin()
        t0 = time.perf_counter_ns()
        if replay is not None and not turn:
            from kvbench.runtime.prefill import replay_prefill

            logits = replay_prefill(model, replay)
        else:
            logits = model(seq[:, start:base + p], start)
        if getattr(model, "recorder", None) is not None and not turn:
            model.recorder.logits = logits
        score(logits, base + p)
        sync()
        firsts.append((time.perf_counter_ns() - t0) * 1e-9)
        counters.step_end(firsts[-1])
        for s in range(1, gen_len + 1):
            counters.step = turn * gen_len + s
            strategy.begin_step(counters.step)
            pos = base + p + s - 1
            counters.step_begin()
            t0 = time.perf_counter_ns()
            score(model(seq[:, pos:pos + 1], pos), pos + 1)
            sync()
            steps.append((time.perf_counter_ns() - t0) * 1e-9)
            counters.step_end(steps[-1])
            if on_step():
                return Outcome(firsts[0], firsts[1:], steps, nll, seq)
    return Outcome(firsts[0], firsts[1:], steps, nll, seq)


def peak_memory() -> dict[str, int]:
    """Allocator peak on CUDA (when present), peak resident set of this process on the host."""
    import torch

    out = {"host": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if torch.cuda.is_available():
        out["accel"] = torch.cuda.max_memory_allocated()
    return out


def records(name: str, params: dict[str, ParamValue], o: Outcome, batch: int,
            accuracy: str, counters: Any, peaks: dict[str, int],
            shadowed: bool = False) -> Iterator[Record]:
    """The run's records: latency, throughput, memory, perplexity and the work trace.

    `shadowed`: an eval run whose full-attention reference (kvbench.runtime.shadow) ran
    between the timed steps; the times are the strategy's (method "shadow" says so) and
    peak memory, which holds the reference's cache, is waived."""
    import numpy as np

    timer = {"timer": "perf_counter_ns", "gc": GC_OFF, "warmup": 1}
    if shadowed:
        timer["shadow"] = ("full-attention reference computed between steps, outside the "
                           "timed region (inputs copied inside it)")
    step_method = {**timer, "reps": len(o.steps), "statistic": "median",
                   "per": "decode step, device synchronised"}
    yield measured("run", name, "ttft", "s", "lower", [o.ttft], params,
                   {**timer, "per": "prefill + first token"})
    if o.appends:
        yield measured("run", name, "append_ttft", "s", "lower", o.appends, params,
                       {**timer, "statistic": "median",
                        "per": "turn >= 1: append of its prompt + first token"})
    yield measured("run", name, "tbt", "s", "lower", o.steps, params, step_method)
    for q in (90, 99):
        yield measured("run", name, f"tbt_p{q}", "s", "lower",
                       [float(np.percentile(o.steps, q))], params,
                       {**step_method, "statistic": f"p{q} of per-step times"})
    yield measured("run", name, "decode_tokens_per_s", "tokens/s", "higher",
                   [batch / s for s in o.steps], params,
                   {**step_method, "per": f"batch ({batch}) / decode step time"})
    for where, n in peaks.items():
        if shadowed:
            yield not_measured("run", name, "peak_memory", "waived", "eval mode: the peak "
                               "holds the full-attention reference's cache beside the "
                               "strategy's; run --mode generate for its own",
                               {**params, "where": where})
            continue
        yield measured("run", name, "peak_memory", "B", "lower", [n], {**params, "where": where},
                       {"statistic": "allocator peak" if where == "accel" else "peak RSS"})
    if params["mode"] == "eval":
        if accuracy:
            yield not_measured("run", name, "perplexity", "waived", accuracy, params)
        else:
            yield measured("run", name, "perplexity", "ppl", "lower",
                           [math.exp(sum(o.nll) / len(o.nll))], params,
                           {"statistic": "exp(mean NLL)", "tokens": len(o.nll),
                            "exact": "deterministic: same tokens, weights, dtype and "
                                     "strategy give the same value"})
    from kvbench.runtime.breakdown import derived

    yield from derived(name, params, o.steps, counters)
    for quantity, where, layer, steps in counters.series():
        p = {**params, "layer": layer, "where": where}
        pre = [steps.get(0, 0.0)]
        dec = [steps.get(s, 0.0) for s in range(1, len(o.steps) + 1)]
        unit = counters.unit(quantity)
        for phase, samples in (("prefill", pre), ("decode", dec)):
            yield measured("run", name, f"trace.{quantity}", unit, "none", samples,
                           {**p, "phase": phase},
                           {"per": "step (prefill: one sample, every turn's prompt)"})
    yield from task_records(name, params, counters.graph, len(o.steps))


def task_records(name: str, params: dict[str, ParamValue], graph: Any,
                 n_steps: int) -> Iterator[Record]:
    """The stage graph (kvbench.runtime.trace), one "trace.tasks" record per step."""
    from kvbench.runtime.trace import COLUMNS, TRACE_VERSION

    for step, tasks in sorted(graph.steps().items()):
        if step > n_steps:  # an interrupted run's unfinished step
            continue
        rec = measured("run", name, "trace.tasks", "tasks", "none", [len(tasks)],
                       {**params, "step": step, "phase": "decode" if step else "prefill"},
                       {"trace_version": TRACE_VERSION, "columns": list(COLUMNS),
                        "tasks": [t.row() for t in tasks],
                        "per": "step: tasks with resource, work and the ids they wait for"})
        yield rec


def run_params(cfg: RunConfig, spec: ModelSpec, layers: int, device: Any, dtype: Any,
               weights: str, sparams: Any) -> dict[str, ParamValue]:
    """Labels carried by every record; `layers` < `layers_total` marks a truncated model."""
    import torch

    p: dict[str, ParamValue] = {
        "model": spec.name, "weights": weights if weights in ("bundled", "random") else "dir",
        "layers": layers, "layers_total": spec.n_layers, "batch": cfg.batch,
        "prompt_len": cfg.prompt_len, "gen_len": cfg.gen_len, "turns": cfg.turns,
        "mode": cfg.mode, **({"depth": cfg.depth} if cfg.mode == "passkey" else {}),
        **({"task": cfg.task} if cfg.task != "passkey" else {}),  # passkey's keys unchanged
        "dtype": str(dtype).removeprefix("torch."), "accel": device.type,
        "threads": torch.get_num_threads(),
        "text": os.path.basename(cfg.text) if cfg.text else "common-licenses"}
    if cfg.prefix_cache:  # only then: other runs keep their record keys
        p.update({"prefix_cache": cfg.prefix_cache, "prefix_chunk": cfg.prefix_chunk})
    own = asdict(sparams)
    require(not own.keys() & p.keys(), f"strategy parameters {sorted(own.keys() & p.keys())} "
            "shadow run options")
    p.update(own)
    return p
