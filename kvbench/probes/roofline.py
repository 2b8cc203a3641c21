"""Roofline probe: peak matmul FLOP/s and memory bandwidth per device, attention intensity.

HGCA section 1 (Fig. 1): decode and append attention are memory-bound. For every device
present (the CPU, each CUDA GPU) this measures the matmul peak (square torch.mm) and the
memory roof (copy traffic: bytes read plus written per second), projects the operational
intensity (FLOP per byte of Q/K/V/O traffic) of prefill, append (32 queries) and decode
attention at a model's shapes, measures those attention steps with kvbench.kernels, and
draws the roofline with the measured points. `linear_gbps`: weight bytes per second of
the decoder's own `Linear` (packed for the rows as a run packs it) at the model's MLP shape,
cycled over 256 MiB of copies, rows from `--linear-rows`: what a decode step's dense layers
stream at (kvbench.hwmodel reads it for `this`). Each device runs in its own dtype and
matmul size: the CPU in --dtype at --matmul, a CUDA GPU in --cuda-dtype (bfloat16, a run's
default there) at --cuda-matmul (8192: a 2048 matmul leaves bf16 tensor cores far from
their peak), its peak in float32 as well (the profile's fallback for float32 runs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import require
from kvbench.options import check_ranges, opt
from kvbench.probes import PROBES, Measure, Probe, RecordOf, in_passes
from kvbench.schema import Record, measured
from kvbench.timing import Policy, time_cuda, time_host
from kvbench.units import gbps

LINEAR_BYTES = 256 << 20  # weights streamed per linear point: beyond any cache
STAGES = {"prefill": None, "append": 32, "decode": 1}  # query length (None: = tokens)


@dataclass(frozen=True)
class RooflineConfig:
    """Options of `kvbench probe roofline` (and of a suite's roofline case)."""

    model: str = opt("opt-6.7b", "Model whose attention and MLP shapes to use.")
    heads: int = opt(0, "Query heads (overrides --model).", min=0)
    kv_heads: int = opt(0, "KV heads (default: --heads).", min=0)
    head_dim: int = opt(0, "Head dimension (with --heads).", min=0)
    tokens: int = opt(2048, "Context tokens of the attention points.")
    batch: int = opt(1, "Batch size of the attention points.")
    dtype: str = opt("float32", "dtype on the CPU: float32, bfloat16 or float16.")
    matmul: int = opt(2048, "Square matmul size for the CPU's peak FLOP/s.")
    cuda_dtype: str = opt("bfloat16", "dtype on CUDA GPUs (a run's default there).")
    cuda_matmul: int = opt(8192, "Square matmul size for a CUDA GPU's peak FLOP/s.")
    min_time: float = opt(0.2, "Seconds to time each quantity at least.")
    linear_rows: str = opt("1,8", "Rows (batch x tokens) of the decode-shaped linear points.")

    def __post_init__(self) -> None:
        check_ranges(self)


def intensity(stage_q: int, tokens: int, batch: int, heads: int, kv_heads: int, head_dim: int,
              elem: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one causal attention step: QK^T and PV over the visible keys
    (2 * 2 * D per query-key pair), Q/O read and written once and K/V read once."""
    lq = stage_q
    visible = lq * tokens - lq * (lq - 1) / 2  # causal: query i sees tokens - lq + i + 1
    flops = 4.0 * batch * heads * head_dim * visible
    nbytes = elem * batch * head_dim * (2 * heads * lq + 2 * kv_heads * tokens)
    return flops, nbytes


def shapes(config: RooflineConfig) -> tuple[str, int, int, int]:
    """(label, heads, kv heads, head dim): explicit --heads/--kv-heads/--head-dim win."""
    from kvbench.models import get_spec

    if config.heads:
        kv = config.kv_heads or config.heads
        require(config.head_dim > 0, "--heads needs --head-dim")
        require(config.heads % kv == 0,
                f"heads ({config.heads}) must be a multiple of kv heads ({kv})")
        return "custom", config.heads, kv, config.head_dim
    spec = get_spec(config.model)
    return spec.name, spec.n_heads, spec.n_kv_heads, spec.head_dim


def device_setup(config: RooflineConfig, device: str) -> tuple[str, int]:
    """(dtype torch name, matmul size) on `device` ("cpu", "cuda:N"): --dtype and --matmul
    on the CPU, --cuda-dtype and --cuda-matmul on a CUDA GPU."""
    from kvbench.units import dtype_name

    if device.startswith("cuda"):
        return dtype_name(config.cuda_dtype, "--cuda-dtype"), config.cuda_matmul
    return dtype_name(config.dtype), config.matmul


@PROBES.register
class RooflineProbe(Probe):
    """Peak FLOP/s and bandwidth per device; attention intensity and points (HGCA Fig. 1)."""

    name = "roofline"
    version = "2"
    config = RooflineConfig
    description = "Measure device roofs and attention points; plots Fig. 1 next to the result file."

    def run(self, config: RooflineConfig) -> Iterator[Record]:
        import torch

        from kvbench.kernels.workload import torch_dtype

        label, heads, kv_heads, head_dim = shapes(config)
        require(config.tokens >= 32 and config.batch > 0 and config.matmul > 0
                and config.cuda_matmul > 0,
                "tokens must be >= 32, batch and matmul sizes positive")
        try:  # checked before the first record, so a rejected command writes nothing
            rows = [int(r) for r in config.linear_rows.split(",")]
        except ValueError:
            rows = []
        require(bool(rows) and min(rows) > 0,
                f"--linear-rows: positive integers, got '{config.linear_rows}'")
        device_setup(config, "cuda")  # --cuda-dtype checked without a GPU too
        devices = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        setup = {d: device_setup(config, d) for d in devices}
        dts = {d: torch_dtype(setup[d][0], d.split(":")[0]) for d in devices}
        policy = Policy(warmup=1, min_reps=3, min_time_s=config.min_time, max_reps=50,
                        max_time_s=max(3.0, 4 * config.min_time))
        base = {"model": label, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                "tokens": config.tokens, "batch": config.batch}
        for name in dict.fromkeys(dt for dt, _ in setup.values()):  # each dtype once
            elem = getattr(torch, name).itemsize
            for stage, q in STAGES.items():
                flops, nbytes = intensity(q or config.tokens, config.tokens, config.batch,
                                          heads, kv_heads, head_dim, elem)
                rec = measured("probe", self.name, "intensity", "FLOP/B", "none",
                               [flops / nbytes], {**base, "dtype": name, "stage": stage},
                               {"formula": "4*B*H*D*visible pairs / (Q+O+K+V bytes)"})
                rec.provenance = "projected"
                yield rec
        for dev in devices:
            with torch.cuda.device(dev) if dev.startswith("cuda") else nullcontext():
                yield from in_passes(self._points(config, rows, dev, dts[dev], setup[dev][1],
                                                  base), policy)

    def _points(self, config: RooflineConfig, rows: list[int], dev: str, dt: Any, n: int,
                base: dict[str, Any]) -> list[tuple[Measure, RecordOf]]:
        """The quantities of one device in dtype `dt`, to be timed together in passes: peak
        matmul FLOP/s of n x n by n x n (also in float32 on a GPU running another dtype),
        copy GB/s, the decode-shaped linear points and attention per stage."""
        import torch

        from kvbench.kernels import dense_attention

        def timed(fn: Callable[[], object]) -> Measure:
            if dev.startswith("cuda"):
                return lambda policy: time_cuda(fn, policy)
            return lambda policy: time_host(fn, policy)

        def rate(metric: str, unit: str, per_s: Callable[[float], float],
                 params: dict[str, Any]) -> RecordOf:
            """The record of a rate: per_s(seconds of one call) in `unit`."""
            return lambda t: measured("probe", self.name, metric, unit, "higher",
                                      [per_s(s) for s in t.seconds], params, t.method())

        name = str(dt).removeprefix("torch.")
        base = {**base, "dtype": name}
        size = 256 << 20
        src = torch.ones(size, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        todo: list[tuple[Measure, RecordOf]] = []
        for mdt in dict.fromkeys([dt] + ([torch.float32] if dev.startswith("cuda") else [])):
            a = torch.randn(n, n, device=dev).to(mdt)
            todo.append((timed(lambda a=a: torch.mm(a, a)),
                         rate("peak_flops", "TFLOP/s", lambda s: 2 * n**3 / s / 1e12,
                              {"device": dev, "dtype": str(mdt).removeprefix("torch."),
                               "n": n})))
        todo.append((timed(lambda: dst.copy_(src)),
                     rate("memory_gbps", "GB/s", lambda s: gbps(2 * size, s),
                          {"device": dev, "bytes": size, "how": "torch copy_, read+write"})))
        todo += [(timed(run), rate("linear_gbps", "GB/s", lambda s, nb=nbytes: gbps(nb, s),
                                   params))
                 for run, nbytes, params in self._linear(config, rows, dev, dt, name)]
        _, heads, kv_heads, head_dim = shapes(config)
        gen = torch.Generator().manual_seed(0)
        k = torch.randn(config.batch, kv_heads, config.tokens, head_dim, generator=gen)
        k, v = k.to(dev, dt), k.flip(2).to(dev, dt)
        for stage, q in STAGES.items():
            lq = q or config.tokens
            qt = torch.randn(config.batch, heads, lq, head_dim).to(dev, dt)
            flops, nbytes = intensity(lq, config.tokens, config.batch, heads, kv_heads,
                                      head_dim, dt.itemsize)
            todo.append((timed(lambda qt=qt: dense_attention(qt, k, v)),
                         rate("attention_tflops", "TFLOP/s", lambda s, f=flops: f / s / 1e12,
                              {**base, "stage": stage, "device": dev,
                               "intensity": round(flops / nbytes, 4)})))
        return todo

    def _linear(self, config: RooflineConfig, points: list[int], dev: str, dt: Any,
                name: str) -> list[tuple[Callable[[], None], int, dict[str, Any]]]:
        """(run, weight bytes, params) per --linear-rows: the weight GB/s of the model's MLP
        up-projection shape [ffn, hidden] (a decoder `Linear`, packed for the rows as a run
        packs it), cycled over enough copies to stream LINEAR_BYTES per call as a decode
        step streams its layers (a single matrix would sit in the caches)."""
        import torch

        from kvbench.models import get_spec
        from kvbench.models.linear import Linear

        spec = get_spec(config.model)
        n_in, n_out = spec.hidden, spec.ffn
        one = n_in * n_out * torch.empty(0, dtype=dt).element_size()
        out = []
        for rows in points:  # weights of their own per point: each packed for its rows
            lins = [Linear(n_in, n_out, bias=False).to(dev, dt)
                    for _ in range(max(1, -(-LINEAR_BYTES // one)))]
            for lin in lins:
                lin.pack(rows, True)
            x = torch.randn(rows, n_in, device=dev).to(dt)

            def run(x: Any = x, lins: list[Any] = lins) -> None:
                with torch.inference_mode():
                    for lin in lins:
                        lin(x)

            nbytes = one * len(lins)
            out.append((run, nbytes, {"device": dev, "dtype": name, "rows": rows,
                                      "shape": f"{n_out}x{n_in}", "weight_bytes": nbytes}))
        return out

    @classmethod
    def plot(cls, records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
        """Fig. 1: per device the roof min(peak, I * bandwidth), stage intensities, points."""
        from kvbench.plots import pyplot, save

        ok = [r for r in records if r.get("name") == cls.name and r["status"] == "ok"]
        peak = {r["params"]["device"]: r["value"] * 1e12 for r in ok if r["metric"] == "peak_flops"}
        bw = {r["params"]["device"]: r["value"] * 1e9 for r in ok if r["metric"] == "memory_gbps"}
        if not peak or not bw:
            return []
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = [2.0 ** (e / 4) for e in range(-16, 53)]
        for dev in sorted(set(peak) & set(bw)):
            line = ax.plot(xs, [min(peak[dev], x * bw[dev]) for x in xs], label=f"{dev} roof")[0]
            pts = [r for r in ok if r["metric"] == "attention_tflops"
                   and r["params"]["device"] == dev]
            ax.scatter([r["params"]["intensity"] for r in pts], [r["value"] * 1e12 for r in pts],
                       color=line.get_color(), zorder=3)
            for r in pts:
                ax.annotate(r["params"]["stage"], (r["params"]["intensity"], r["value"] * 1e12),
                            fontsize=7, xytext=(3, 3), textcoords="offset points")
        for r in ok:
            if r["metric"] == "intensity":
                ax.axvline(r["value"], color="grey", ls=":", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("operational intensity (FLOP/byte)")
        ax.set_ylabel("FLOP/s")
        ax.set_title("attention roofline (dotted: projected stage intensities)", fontsize=9)
        ax.legend(fontsize=8)
        return [save(fig, out_dir / "roofline-fig1.png")]
