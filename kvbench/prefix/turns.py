"""`kvbench run STRATEGY --turns N --prefix-cache TIER`: a turn's TTFT three ways.

CXL KV-storage paper section 3.2 (Fig. 1b) compares, for a follow-up request whose prefix
was computed before: full KV re-compute, prefix caching from CXL (PC-CXL) and prefix caching
in GPU memory (PC-GPU). Between turns of a multi-turn run (`decode_run`'s `between` hook),
the finished turn's KV is saved to the tier (`save`, one copy per row), then turn k's
request, the whole conversation so far plus its new prompt (tokens [0, kn + P), n = P + G +
1), is timed as a fresh request on a fresh strategy along three paths:

- recompute: prefill all kn + P tokens (copy: nothing);
- load: look the request up in the cache, copy the hit h tokens (whole chunks) from the
  tier into the strategy (`PrefixCache.load` + `Strategy.import_kv`: the copy time), then
  prefill the remaining kn + P - h tokens after them (the compute time);
- resident (PC-GPU): the same h tokens already in the strategy's accelerator buffers (set
  up untimed from the running strategy's export), then the same compute.

Each path is repeated (`reps`, one warm-up) with `timing.time_stages` and recorded per turn
with copy and compute split, the tokens and bytes loaded, and the load path's logits
against recompute (max |difference|, same argmax) and against resident (bitwise equal:
both compute on the same KV bits unless the tier changed them). The main run is untouched:
its own append of turn k (its `append_ttft`) follows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbench.errors import require
from kvbench.prefix.cache import PrefixCache
from kvbench.prefix.tiers import parse_tier
from kvbench.schema import ParamValue, Record, measured
from kvbench.timing import Policy, time_stages
from kvbench.units import format_bytes, parse_size

if TYPE_CHECKING:
    import torch

    from kvbench.models import ModelSpec
    from kvbench.runtime.run import RunConfig
    from kvbench.strategies import Strategy

PATHS = ("recompute", "load", "resident")


@dataclass
class TurnResult:
    """One turn's three paths: per path (copy seconds, compute seconds) samples."""

    turn: int
    request: int  # tokens of the request
    hit: int  # tokens loaded from the tier
    bytes_loaded: int
    save_s: float
    bytes_saved: int
    times: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    max_diff: float = 0.0  # |load logits - recompute logits|
    argmax_agree: float = 0.0
    bitwise: bool = False  # load logits == resident logits


def open_cache(cfg: RunConfig, cls: type[Strategy], spec: ModelSpec, layers: int,
               dtype: torch.dtype, device: torch.device, buffer: Any = None) -> PrefixCache:
    """Check the run's prefix-cache options (one-line errors) and open the cache: the tier
    exists here, its capacity holds at least one turn's save (turn 0: batch x P + G
    tokens), --prefix-chunk and --prefix-reps are at least 1."""
    from kvbench.strategies import supports_prefix

    require(supports_prefix(cls), f"--prefix-cache: strategy '{cls.name}' does not export "
            "and import its KV (full and hgca do)")
    require(cfg.turns >= 2, "--prefix-cache saves a finished turn's KV for the next turn: "
            "pass --turns 2 or more")
    require(cfg.prefix_chunk >= 1 and cfg.prefix_reps >= 1,
            "--prefix-chunk and --prefix-reps must be at least 1")
    tier = parse_tier(cfg.prefix_cache)
    token_bytes = spec.kv_bytes_per_token(dtype.itemsize, layers)
    first = (cfg.prompt_len + cfg.gen_len) // cfg.prefix_chunk * cfg.prefix_chunk
    need = cfg.batch * first * token_bytes
    capacity = 2 * cfg.batch * cfg.seq_len * token_bytes if cfg.prefix_capacity == "0" \
        else parse_size(cfg.prefix_capacity)
    require(capacity >= need, f"--prefix-capacity {cfg.prefix_capacity} "
            f"({format_bytes(capacity)}) is smaller than one turn's KV: batch {cfg.batch} x "
            f"{first} tokens x {token_bytes} B/token = {format_bytes(need)}")
    meta = {"model": spec.name, "layers": layers, "dtype": str(dtype).removeprefix("torch."),
            "kv_heads": spec.n_kv_heads, "head_dim": spec.head_dim}
    return PrefixCache(tier, capacity, cfg.prefix_chunk, meta, device, buffer)


def tier_info(cache: PrefixCache) -> dict[str, Any]:
    """What every prefix record's method says about the tier."""
    return {"tier": str(cache.tier.spec), "placement": cache.tier.placement,
            "pinned": cache.tier.pinned, "capacity_bytes": cache.tier.capacity,
            "chunk": cache.chunk}


class PrefixTurns:
    """The `between` hook of a prefix-cache run and its records."""

    def __init__(self, cache: PrefixCache, model: Any, fresh: Callable[[], Strategy],
                 restore: Callable[[], None], sync: Callable[[], None], reps: int,
                 prompt_len: int, gen_len: int) -> None:
        self.cache, self.model, self.fresh, self.restore = cache, model, fresh, restore
        self.sync, self.p, self.n = sync, prompt_len, prompt_len + gen_len + 1
        self.policy = Policy(warmup=1, min_reps=reps, min_time_s=0.0, max_reps=reps)
        self.results: list[TurnResult] = []

    def between(self, turn: int, seq: torch.Tensor, main: Strategy) -> None:
        """Before turn `turn`'s prompt: save the finished KV, time the three paths."""
        import time

        import torch

        main = getattr(main, "inner", main)  # eval mode: the strategy under the shadow
        base = turn * self.n
        kv = main.export_kv()
        t0 = time.perf_counter_ns()
        saved = self.cache.save(seq[:, :base - 1], kv)  # the last token is not fed yet
        self.sync()
        save_s = (time.perf_counter_ns() - t0) * 1e-9
        request = seq[:, :base + self.p]
        limit = base + self.p - 1  # at least one token is computed (its logits)
        logits: dict[str, torch.Tensor] = {}
        state: dict[str, Any] = {}

        def setup() -> dict[str, Any]:
            return {"s": self.fresh()}

        def load_copy(st: dict[str, Any]) -> None:
            st["h"], got = self.cache.load(request, limit)
            if st["h"]:
                st["s"].import_kv(got)
            state["h"] = st["h"]
            state["loads"] = state.get("loads", 0) + 1

        def compute_from(key: str) -> Callable[[dict[str, Any]], None]:
            def run(st: dict[str, Any]) -> None:
                h = st.get("h", 0)
                logits[key] = self.model(request[:, h:], h)
            return run

        res = TurnResult(turn, request.shape[1], 0, 0, save_s, saved)
        loaded0 = self.cache.stats.bytes_loaded
        timings = {"load": time_stages(setup, [load_copy, compute_from("load")], self.policy,
                                       self.sync)}
        res.bytes_loaded = (self.cache.stats.bytes_loaded - loaded0) // state["loads"]
        res.hit = state["h"]
        h_res = res.hit or (base - 1) // self.cache.chunk * self.cache.chunk
        resident = [(k[:, :, :h_res], v[:, :, :h_res]) for k, v in kv]

        def resident_setup() -> dict[str, Any]:
            s = self.fresh()
            s.import_kv(resident)
            return {"s": s, "h": h_res}

        def nothing(st: dict[str, Any]) -> None:
            """Nothing to copy: the timed stage is empty."""

        timings["resident"] = time_stages(resident_setup, [nothing, compute_from("resident")],
                                          self.policy, self.sync)
        timings["recompute"] = time_stages(setup, [nothing, compute_from("recompute")],
                                           self.policy, self.sync)
        self.restore()
        for path in PATHS:
            copy, compute = timings[path]
            res.times[path] = (list(copy.seconds), list(compute.seconds))
        res.max_diff = float((logits["load"] - logits["recompute"]).abs().max())
        res.argmax_agree = float((logits["load"].argmax(-1) == logits["recompute"].argmax(-1))
                                 .float().mean())
        res.bitwise = bool(res.hit) and torch.equal(logits["load"], logits["resident"])
        self.results.append(res)

    def records(self, name: str, params: dict[str, ParamValue], tier_info: dict[str, Any]
                ) -> list[Record]:
        """Per turn and path: TTFT, its copy and compute parts; per turn the load path's
        tokens/bytes, logits check and the save; the cache's counters."""
        method = {"timer": "perf_counter_ns (device synchronised)", "warmup": 1,
                  "statistic": "median", "per": "fresh request: copy + compute",
                  **tier_info}
        out = []
        for r in self.results:
            for path in PATHS:
                copy, compute = r.times[path]
                p = {**params, "turn": r.turn, "path": path, "request_tokens": r.request,
                     "prefix_tokens": 0 if path == "recompute" else (
                         r.hit or (r.turn * self.n - 1) // self.cache.chunk * self.cache.chunk)}
                total = [a + b for a, b in zip(copy, compute, strict=True)]
                for metric, samples in (("prefix_ttft", total), ("prefix_ttft_copy", copy),
                                        ("prefix_ttft_compute", compute)):
                    out.append(measured("run", name, metric, "s", "lower", samples, p,
                                        {**method, "reps": len(samples)}))
            p = {**params, "turn": r.turn, "path": "load"}
            out.append(measured("run", name, "prefix_tokens_loaded", "tokens", "higher",
                                [r.hit], p, {"per": "request row (shortest row's hit)"}))
            out.append(measured("run", name, "prefix_bytes_loaded", "B", "none",
                                [r.bytes_loaded], p, {"per": "load of one request, all rows"}))
            out.append(measured("run", name, "prefix_logits_max_abs_diff", "logit", "lower",
                                [r.max_diff], p, {
                                    "against": "recompute", "argmax_agree": r.argmax_agree,
                                    "bitwise_equal_resident": r.bitwise}))
            out.append(measured("run", name, "prefix_save_time", "s", "lower", [r.save_s],
                                {**params, "turn": r.turn}, {
                                    "timer": "perf_counter_ns", "reps": 1,
                                    "bytes_saved": r.bytes_saved}))
        st = self.cache.stats
        for metric, unit, value in (("prefix_hits", "chunks", st.hits),
                                    ("prefix_misses", "chunks", st.misses),
                                    ("prefix_evictions", "entries", st.evictions),
                                    ("prefix_saves", "entries", st.saves),
                                    ("prefix_rejected", "entries", st.rejected)):
            out.append(measured("run", name, metric, unit, "none", [value], params,
                                {"per": "run", "lookups": st.lookups, **tier_info}))
        return out

