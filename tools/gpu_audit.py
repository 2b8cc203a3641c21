"""Per strategy and decode step, what a GPU decode step does (GPU campaign item 2, audit
findings #4, #5 and #14): one JSON line per (strategy, step) with

- syncs: device synchronisations inside `strategy.decode` (torch.cuda.set_sync_debug_mode
  "warn", scoped to the strategy's decode calls, so the decoder's own work is left out), and
  where they come from (file:line of the Python frame that synchronised, with counts);
- enqueue_s / wait_s: host time to issue the step, then time in torch.cuda.synchronize();
- nan: whether the step's logits hold a NaN (the padded-gather NaN of finding #4);
- on the last --profiled steps (under torch.profiler, CUDA activity; their enqueue times
  include the profiler's cost): kernels launched, memcpys, and those from or to pageable
  memory (hidden syncs that the debug mode does not flag, finding #5).

    python3 tools/gpu_audit.py --out out/gpu/A/audit.jsonl

Every registered strategy runs with random weights (llama-3.1-8b, 4 layers, batch 2, prompt
2048, bf16) and the KV-bound smoke's parameters scaled down (SCALED). A strategy that fails
gets one line with its error and the audit goes on. Without CUDA: one line, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError

# The smoke's KV-bound parameters (tools/gpu-smoke E8) at this script's 2K context: budgets
# of 256 tokens in 16-token pages, one dense layer, so that 3 of 4 layers are sparse
SCALED: dict[str, Any] = {"gpu_share": 0.125, "budget_tokens": 256, "page_size": 16,
                          "dense_layers": 1, "resident_blocks": 4}
SYNC_TEXT = "synchroniz"  # torch's warning: "called a synchronizing CUDA operation"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_audit.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="JSONL file (appended; default: stdout)")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8, help="decode steps timed without profiler")
    p.add_argument("--profiled", type=int, default=2, help="decode steps after those, profiled")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--strategies", default="", help="comma-separated (default: all)")
    return p


def scaled_params(cls: Any, max_len: int) -> tuple[Any, list[str]]:
    """cls's parameters with SCALED's values for the fields it has, resolved for a cache of
    max_len tokens (`Strategy.for_run`, as `kvbench run` does)."""
    names = {f.name for f in dataclasses.fields(cls.params)}
    params = cls.params(**{k: v for k, v in SCALED.items() if k in names})
    return cls.for_run(params, max_len)


def copy_kinds(names: Iterable[str]) -> dict[str, int]:
    """Counts of a profiled step's CUDA activity names: kernels, memcpys (torch.profiler's
    "Memcpy HtoD (Pageable -> Device)" style names), pageable memcpys and memsets."""
    out = {"kernels": 0, "memcpy": 0, "memcpy_pageable": 0, "memset": 0}
    for name in names:
        if name.startswith("Memcpy"):
            out["memcpy"] += 1
            out["memcpy_pageable"] += "Pageable" in name
        elif name.startswith("Memset"):
            out["memset"] += 1
        else:
            out["kernels"] += 1
    return out


def scoped_syncs(strategy: Any) -> None:
    """Run strategy.decode under sync debug mode "warn" (and only it)."""
    import torch

    inner = strategy.decode

    def decode(layer: int, q: Any, k: Any, v: Any) -> Any:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return inner(layer, q, k, v)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    strategy.decode = decode


def _where(w: warnings.WarningMessage) -> str:
    """file:line of a warning, relative to the checkout (kvbench/..., tests/...)."""
    import kvbench

    path = Path(w.filename).resolve()
    root = Path(kvbench.__file__).resolve().parent.parent
    return f"{path.relative_to(root) if path.is_relative_to(root) else path.name}:{w.lineno}"


def audit(cls: Any, model: Any, a: argparse.Namespace, device: Any, dtype: Any
          ) -> Iterator[dict[str, Any]]:
    """Prefill, then a.steps + a.profiled decode steps of strategy `cls`: one dict per step."""
    import torch

    from kvbench.runtime.context import Counters, RunContext

    spec = model.spec
    max_len = a.prompt_len + a.steps + a.profiled + 1
    params, notes = scaled_params(cls, max_len)
    counters = Counters(spec.n_kv_heads, dtype.itemsize, device.type == "cuda", a.layers)
    ctx = RunContext(spec, a.layers, a.batch, max_len, dtype, device, torch.device("cpu"),
                     counters, model)
    strategy = cls(params, ctx)
    scoped_syncs(strategy)
    model.setup(strategy, counters, max_len)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(spec.vocab, (a.batch, a.prompt_len), generator=gen).to(device)
    base = {"strategy": cls.name, "params": dataclasses.asdict(params), "notes": notes,
            "model": spec.name, "layers": a.layers, "batch": a.batch,
            "prompt_len": a.prompt_len, "dtype": str(dtype).removeprefix("torch.")}
    counters.step = 0
    strategy.begin_step(0)
    tok = model(prompt, 0).argmax(-1, keepdim=True)
    torch.cuda.synchronize()
    try:
        for s in range(1, a.steps + a.profiled + 1):
            profiled = s > a.steps
            counters.step = s
            strategy.begin_step(s)
            activity = [torch.profiler.ProfilerActivity.CUDA]
            with warnings.catch_warnings(record=True) as caught, (
                    torch.profiler.profile(activities=activity) if profiled
                    else contextlib.nullcontext()) as prof:
                warnings.simplefilter("always")
                t0 = time.perf_counter_ns()
                logits = model(tok, a.prompt_len + s - 1)
                t1 = time.perf_counter_ns()
                torch.cuda.synchronize()
                t2 = time.perf_counter_ns()
            counters.resolve()
            syncs = Counter(_where(w) for w in caught if SYNC_TEXT in str(w.message))
            line = {**base, "step": s, "syncs": sum(syncs.values()), "sync_sites": dict(syncs),
                    "enqueue_s": (t1 - t0) * 1e-9, "wait_s": (t2 - t1) * 1e-9,
                    "nan": bool(torch.isnan(logits).any()), "profiled": profiled}
            if prof is not None:
                line.update(copy_kinds(e.name for e in prof.events()
                                       if str(e.device_type).endswith("CUDA")))
            yield line
            tok = logits.argmax(-1, keepdim=True)
    finally:
        model.strategy = None


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_audit.py: error: no CUDA GPU on this machine", file=sys.stderr)
        return 2
    from kvbench.models import get_spec
    from kvbench.models.weights import load
    from kvbench.strategies import STRATEGIES
    from kvbench.units import dtype_name

    try:
        names = a.strategies.split(",") if a.strategies else STRATEGIES.names()
        classes = [STRATEGIES.get(n) for n in names]
        spec, dtype = get_spec(a.model), getattr(torch, dtype_name(a.dtype))
        device = torch.device("cuda", torch.cuda.current_device())
        model = load(spec, "random", a.layers, dtype, device).model
    except KvbenchError as e:
        print(f"gpu_audit.py: error: {e}", file=sys.stderr)
        return 2
    out = a.out.open("a") if a.out else sys.stdout

    def emit(line: dict[str, Any]) -> None:
        print(json.dumps(line), file=out, flush=True)

    try:
        for cls in classes:
            try:
                for line in audit(cls, model, a, device, dtype):
                    emit(line)
            except Exception as e:  # one strategy's failure is a finding, not the end
                where = traceback.extract_tb(e.__traceback__)[-1]
                emit({"strategy": cls.name, "error": f"{type(e).__name__}: {e}",
                      "at": f"{where.filename}:{where.lineno}"})
            torch.cuda.empty_cache()
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
