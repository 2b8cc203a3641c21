"""`kvbench serve-sim`: TTFT vs batch under a TTFT SLO, recompute vs prefix cache per tier
(CXL KV-storage paper section 3.3, Fig. 1c), then a serving simulation driven by it.

Measured (the bundled model under `full`, on this machine's accelerator role): for each
batch size B, a batch of B follow-up requests of `context` tokens whose first `prefix`
tokens (the context minus the new share r, in whole chunks) were saved by an earlier turn:
- recompute: prefill all B x context tokens;
- prefix cache on each tier: load B x prefix tokens (copy), prefill B x new tokens (compute);
- resident (the paper's PC-GPU): the prefix already in the strategy's accelerator buffers
  (set up untimed), the same compute;
- one decode step of the batch after the prefix (`serve_decode_step`, reported only: the
  simulated instance is a prefill instance, decode disaggregated as in DistServe, the
  paper's reference for the 400 ms SLO).
Each is timed with `timing.time_stages` (one warm-up, `reps` repetitions, median). The
largest measured batch whose median TTFT is within the SLO is Fig. 1c's maximum batch.

Simulated (provenance "projected": a model fed with the measurements above): `requests`
requests arrive as a Poisson process of rate lambda (exponential gaps, seeded); each is a
follow-up with probability h (its prefix cached), otherwise an initial request (computed
whole under every policy); every request has the measured shape (context tokens, new share
r: the times are measured for that shape only). A batch's prefill time is a least-squares
line a + b n over the measured batch sizes for each path, a mixed batch taking max(a) plus
each request's b; batches never exceed the largest measured B. The scheduler is one
prefill engine: when idle it admits waiting requests in arrival order while every admitted
request's TTFT (its wait plus the batch's predicted time) stays within the SLO (a request
already past it goes alone), runs the batch, repeats. Per rate: SLO attainment, TTFT
median and p99, mean batch; goodput = the highest rate with at least 90% attainment.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvbench.errors import require
from kvbench.options import opt


@dataclass(frozen=True)
class ServeConfig:
    """`kvbench serve-sim` options."""

    tiers: str = opt("host:0", "Prefix-cache tiers to compare with recompute, comma-separated "
                     "(accel, host:N, disk:PATH).")
    context: int = opt(256, "Tokens per request (cached prefix + new prompt).")
    new_ratio: float = opt(0.125, "r: the new prompt's share of a request's tokens.")
    batches: str = opt("1,2,4,8", "Batch sizes to measure.")
    slo: float = opt(0.4, "TTFT SLO in seconds (the paper's 400 ms; scale it to the machine).")
    h: float = opt(1.0, "Share of requests that are follow-ups with a cached prefix.")
    rates: str = opt("", "Request rates to simulate, req/s, comma-separated (default: 0.25x to "
                     "8x of recompute's measured throughput at the largest batch).")
    requests: int = opt(2000, "Requests per simulated rate.")
    reps: int = opt(3, "Timed repetitions per measurement (after one warm-up).")
    chunk: int = opt(16, "Tokens per prefix-cache chunk.")
    threads: int = opt(0, "Torch CPU threads (0: torch's default).")
    seed: int = opt(0, "Seed of the arrivals.")

    def __post_init__(self) -> None:
        require(self.slo > 0, f"--slo {self.slo}: the TTFT SLO must be above 0 s")
        require(0 < self.new_ratio < 1, f"--new-ratio {self.new_ratio}: must be in (0, 1)")
        require(0 <= self.h <= 1, f"--h {self.h}: must be in [0, 1]")
        require(self.context >= 2 and self.requests >= 1 and self.reps >= 1 and
                self.chunk >= 1 and self.threads >= 0, "--context must be at least 2; "
                "--requests, --reps and --chunk at least 1; --threads at least 0")

    @property
    def prefix(self) -> int:
        return int(self.context * (1 - self.new_ratio)) // self.chunk * self.chunk

    def batch_sizes(self) -> list[int]:
        try:
            out = sorted({int(b) for b in self.batches.split(",") if b.strip()})
        except ValueError:
            out = []
        require(bool(out) and out[0] >= 1, f"--batches '{self.batches}': positive integers")
        return out

    def rate_list(self) -> list[float]:
        try:
            out = [float(r) for r in self.rates.split(",") if r.strip()]
        except ValueError:
            out = [-1.0]
        require(all(r > 0 for r in out), f"--rates '{self.rates}': positive numbers")
        return out


def fit(batches: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least-squares a, b of seconds = a + b * batch (b alone for one batch size)."""
    import numpy as np

    if len(batches) == 1:
        return 0.0, seconds[0] / batches[0]
    b, a = np.polyfit(np.asarray(batches, float), np.asarray(seconds, float), 1)
    return max(float(a), 0.0), max(float(b), 1e-12)


def simulate(rate: float, n: int, h: float, slo: float, cost: dict[str, tuple[float, float]],
             max_batch: int, seed: int) -> dict[str, float]:
    """One Poisson run (module docstring); cost: 'initial' and 'follow' -> (a, b)."""
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        arrivals.append((t, "follow" if rng.random() < h else "initial"))
    queue: deque[tuple[float, str]] = deque()
    ttft, sizes, i, now = [], [], 0, 0.0
    while i < n or queue:
        if not queue:
            now = max(now, arrivals[i][0])
        while i < n and arrivals[i][0] <= now:
            queue.append(arrivals[i])
            i += 1
        batch: list[tuple[float, str]] = []
        for req in list(queue):
            trial = [*batch, req]
            time = max(cost[k][0] for _, k in trial) + sum(cost[k][1] for _, k in trial)
            if len(trial) > max_batch or (batch and now + time - trial[0][0] > slo):
                break
            batch = trial
        for _ in batch:
            queue.popleft()
        now += max(cost[k][0] for _, k in batch) + sum(cost[k][1] for _, k in batch)
        ttft += [now - a for a, _ in batch]
        sizes.append(len(batch))
    ttft.sort()
    return {"attainment": sum(x <= slo for x in ttft) / n, "ttft_p50": ttft[n // 2],
            "ttft_p99": ttft[min(n - 1, int(0.99 * n))], "mean_batch": sum(sizes) / len(sizes),
            "served_rps": n / now}


def goodput(rows: dict[float, dict[str, float]]) -> float:
    """The highest simulated rate with >= 90% SLO attainment (0: none)."""
    return max((r for r, m in rows.items() if m["attainment"] >= 0.9), default=0.0)


def measure(cfg: ServeConfig) -> dict[str, Any]:
    """TTFT per batch and path, copy and compute split, and decode steps (docstring)."""
    import torch

    from kvbench.models import get_spec
    from kvbench.models.weights import load
    from kvbench.prefix.cache import PrefixCache
    from kvbench.prefix.tiers import parse_tier
    from kvbench.runtime.context import Counters, RunContext
    from kvbench.runtime.run import read_text, token_rows
    from kvbench.strategies import NoParams
    from kvbench.strategies.full import Full
    from kvbench.timing import Policy, time_stages

    spec = get_spec("smollm2-135m")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    tiers = [parse_tier(t) for t in cfg.tiers.split(",") if t.strip()]
    sizes = cfg.batch_sizes()
    require(cfg.prefix >= cfg.chunk, f"--context {cfg.context} with --new-ratio "
            f"{cfg.new_ratio} leaves no whole chunk of {cfg.chunk} tokens to cache")
    loaded = load(spec, "bundled", spec.n_layers, dtype, device, 0)
    model, ids = loaded.model, loaded.encode(read_text(""))
    meta = {"model": spec.name, "layers": spec.n_layers, "dtype": str(dtype)[6:],
            "kv_heads": spec.n_kv_heads, "head_dim": spec.head_dim}
    need = 2 * max(sizes) * cfg.prefix * spec.kv_bytes_per_token(dtype.itemsize)
    caches = {str(t): PrefixCache(t, need, cfg.chunk, meta, device) for t in tiers}
    policy = Policy(warmup=1, min_reps=cfg.reps, min_time_s=0.0, max_reps=cfg.reps)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    length, p = cfg.context, cfg.prefix

    def fresh(batch: int) -> Full:
        ctx = RunContext(spec, spec.n_layers, batch, length + 1, dtype, device,
                         torch.device("cpu"), Counters(spec.n_kv_heads, dtype.itemsize, cuda),
                         model)
        s = Full(NoParams(), ctx)
        model.setup(s, ctx.counters, length + 1)
        return s

    out: dict[str, Any] = {"ttft": {}, "decode": {}, "placement": {}}
    for b in sizes:
        rows = token_rows(ids, b, length + 1, spec.vocab).to(device)
        first = fresh(b)
        model(rows[:, :p], 0)  # the earlier turn whose KV is saved
        for name, c in caches.items():
            c.save(rows[:, :p], first.export_kv())
            out["placement"][name] = c.tier.placement

        def nothing(st: dict) -> None:
            """Recompute copies nothing."""

        def compute(st: dict, rows: Any = rows) -> None:
            h = st.get("h", 0)
            model(rows[:, h:length], h)

        t = time_stages(lambda b=b: {"s": fresh(b)}, [nothing, compute], policy, sync)
        out["ttft"][("recompute", b)] = t
        for name, c in caches.items():
            def copy(st: dict, c: PrefixCache = c, rows: Any = rows) -> None:
                st["h"], kv = c.load(rows[:, :length], length - 1)
                st["s"].import_kv(kv)

            out["ttft"][(name, b)] = time_stages(lambda b=b: {"s": fresh(b)},
                                                 [copy, compute], policy, sync)

        def resident(b: int = b, first: Full = first) -> dict:
            s = fresh(b)
            s.import_kv(first.export_kv())
            return {"s": s, "h": p}

        out["ttft"][("resident", b)] = time_stages(resident, [nothing, compute], policy, sync)
        out["decode"][b] = time_stages(resident, [lambda st, rows=rows: model(
            rows[:, p:p + 1], p)], policy, sync)[0]
    for c in caches.values():
        c.close()
    out["device"], out["dtype"] = device.type, str(dtype)[6:]
    return out


def run(cfg: ServeConfig) -> list[Any]:
    """Measure, simulate, print both tables; the records (measured, then projected)."""
    from rich.table import Table

    from kvbench.console import console
    from kvbench.schema import Record, measured
    from kvbench.units import format_seconds

    m = measure(cfg)
    sizes = cfg.batch_sizes()
    base = {"model": "smollm2-135m", "context": cfg.context, "prefix": cfg.prefix,
            "new_ratio": cfg.new_ratio, "chunk": cfg.chunk, "slo": cfg.slo,
            "accel": m["device"], "dtype": m["dtype"]}
    recs: list[Record] = []
    paths = ["recompute", *[str(t) for t in m["placement"]], "resident"]
    t = Table(title=f"TTFT vs batch (Fig. 1c analog): {cfg.context}-token follow-ups, "
              f"{cfg.prefix} cached, SLO {format_seconds(cfg.slo)} [measured, median]")
    t.add_column("batch")
    for path in paths:
        t.add_column(f"{path} (copy + compute)")
    t.add_column("decode step")
    for b in sizes:
        cells = []
        for path in paths:
            copy, comp = m["ttft"][(path, b)]
            total = [x + y for x, y in zip(copy.seconds, comp.seconds, strict=True)]
            p = {**base, "batch": b, "path": path}
            meth = {**copy.method(), "per": "batch prefill: copy + compute",
                    "placement": m["placement"].get(path, "")}
            for metric, samples in (("serve_ttft", total), ("serve_ttft_copy", copy.seconds),
                                    ("serve_ttft_compute", comp.seconds)):
                recs.append(measured("run", "serve-sim", metric, "s", "lower", samples, p, meth))
            v = recs[-3].value
            cells.append(f"{format_seconds(v)} ({format_seconds(copy.median)} + "
                         f"{format_seconds(comp.median)})" + (" *" if v > cfg.slo else ""))
        dec = m["decode"][b]
        recs.append(measured("run", "serve-sim", "serve_decode_step", "s", "lower",
                             dec.seconds, {**base, "batch": b}, dec.method()))
        t.add_row(str(b), *cells, format_seconds(dec.median))
    console.print(t)
    console.print("[dim]*: over the SLO[/]")
    sim = Table(title=f"Poisson serving simulation, h = {cfg.h}, {cfg.requests} requests per "
                "rate [projected from the measured batch times]")
    for col in ("path", "max batch <= SLO", "rate req/s", "SLO attained", "TTFT p50",
                "TTFT p99", "mean batch"):
        sim.add_column(col)
    rc = fit(sizes, [m["ttft"][("recompute", b)][1].median for b in sizes])
    rates = cfg.rate_list() or [round(f * max(sizes) / (rc[0] + rc[1] * max(sizes)), 4)
                                for f in (0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8)]
    for path in paths:
        med = [sum(x.median for x in m["ttft"][(path, b)]) for b in sizes]
        best = max((b for b, v in zip(sizes, med, strict=True) if v <= cfg.slo), default=0)
        p = {**base, "path": path}
        recs.append(measured("run", "serve-sim", "serve_max_batch_under_slo", "requests",
                             "higher", [best], p, {"per": "largest measured batch whose "
                                                   "median TTFT is within the SLO"}))
        follow = fit(sizes, med)
        cost = {"initial": rc, "follow": rc if path == "recompute" else follow}
        rows = {r: simulate(r, cfg.requests, cfg.h, cfg.slo, cost, max(sizes), cfg.seed)
                for r in rates}
        for r, s in rows.items():
            for metric, unit, value in (("sim_slo_attainment", "ratio", s["attainment"]),
                                        ("sim_ttft_p50", "s", s["ttft_p50"]),
                                        ("sim_ttft_p99", "s", s["ttft_p99"]),
                                        ("sim_mean_batch", "requests", s["mean_batch"])):
                recs.append(Record("run", "serve-sim", metric, unit, "none", value,
                                   {**p, "rate": r, "h": cfg.h}, [value],
                                   provenance="projected", method={"fit": cost}))
            sim.add_row(path, str(best), f"{r:.3g}", f"{s['attainment']:.1%}",
                        format_seconds(s["ttft_p50"]), format_seconds(s["ttft_p99"]),
                        f"{s['mean_batch']:.2f}")
        g = goodput(rows)
        recs.append(Record("run", "serve-sim", "sim_goodput", "requests/s", "higher", g,
                           {**p, "h": cfg.h}, [g], provenance="projected",
                           method={"per": "highest simulated rate with >= 90% of TTFTs "
                                          "within the SLO", "fit": cost}))
    console.print(sim)
    return recs
