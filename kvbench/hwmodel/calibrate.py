"""`kvbench calibrate`: the probes `kvbench project --hardware this` builds its profile from
(kvbench.hwmodel.this), run once per machine at the shapes of the models to project, and
stored under kvbench's cache keyed by the machine.

What runs (`plan`), from each model's spec (kvbench.models) and the batch sizes:
    timer       per-op overhead of small torch ops (the launch cost), once
    roofline    peak FLOP/s of a square matmul of the model's hidden size (at most
                this.MATMUL_CAP), the memory GB/s, and the decoder's `Linear` at the model's
                MLP shape [ffn, hidden] with the batch sizes and DENSE_ROWS (QUICK_ROWS with
                --quick) as rows
    attention   CPU dense and sparse decode (GPU decode too with CUDA) at the model's head
                shape and the batch sizes, host tokens 64, 256, ... (x4; x16 with --quick) up
                to the model's context or KV_CAP of KV per layer
    bandwidth   the copy curve (host:0 -> host:0 pageable; with CUDA host:0 <-> gpu:0,
                pinned and pageable) from one token's K and V of one layer to the largest
                layer of KV an attention point holds
Stored in <cache>/calibration/<machine key>/ (<cache>: $KVBENCH_CACHE, default
~/.cache/kvbench): probes.jsonl, a kvbench result file whose records each carry the
`kvbench probe` command that reproduces them, and calibration.json (models, shapes, times).
`stored` gives `--hardware this` that calibration's records, or one line naming why not:
none for this machine (and the command to run), another machine's, a probe version this
kvbench no longer has, or a model it was not calibrated for.

The machine key (machine_key) hashes what fixes a machine's speeds: host name, CPU model,
core counts and caches, memory (GiB), NUMA node count and GPU names; not what changes with
load or between runs (affinity, governor, torch threads) nor software versions (the probe
versions are checked one by one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError, require
from kvbench.hwmodel.this import model_params
from kvbench.models import ModelSpec, get_spec

DEFAULT_MODELS = ("smollm2-135m",)  # the model `kvbench run` runs by default
DEFAULT_BATCH = (1, 8)
# linear rows besides the batch sizes (decode rows): prefill rows (batch x tokens) past 256
# are compute-bound, where the peak matmul bounds them (dense_gbps is flat past its end)
DENSE_ROWS = (1, 4, 16, 64, 256)
QUICK_ROWS = (1, 16)  # --quick: 256 rows cost most of the roofline's time; rows past the
# last point are then timed by the peak matmul alone (the bytes' term is the smaller there)
MIN_TOKENS = 64
KV_CAP = 256 << 20  # past every LLC: rates are flat beyond, as curves are read past their ends
ROOFLINE_TOKENS = 512  # context of the roofline's attention points, which `this` does not read
RECORDS, MANIFEST = "probes.jsonl", "calibration.json"


@dataclass(frozen=True)
class CalibrateConfig:
    """Options of `kvbench calibrate`: the models whose shapes to probe at, the batch sizes
    the projections run at, the dtype, and --quick (shorter probes, noisier)."""

    models: tuple[str, ...] = DEFAULT_MODELS
    batch: tuple[int, ...] = DEFAULT_BATCH
    dtype: str = "auto"  # the accelerator's: auto is float32 on a CPU, bfloat16 on CUDA
    quick: bool = False

    def __post_init__(self) -> None:
        from kvbench.units import dtype_name

        require(bool(self.models), "--model: give at least one model")
        for m in self.models:
            get_spec(m)
        object.__setattr__(self, "models", tuple(dict.fromkeys(self.models)))
        require(bool(self.batch) and all(b >= 1 for b in self.batch),
                f"--batch {','.join(map(str, self.batch))}: positive integers")
        object.__setattr__(self, "batch", tuple(sorted(set(self.batch))))
        if self.dtype != "auto":
            object.__setattr__(self, "dtype", dtype_name(self.dtype))

    def accel_dtype(self, cuda: bool) -> str:
        """The dtype runs use on this machine's accelerator (a run's default for auto)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if cuda else "float32"

    @classmethod
    def of(cls, models: Sequence[str], batch: str, dtype: str, quick: bool) -> CalibrateConfig:
        """The config of the command line: `batch` comma-separated ("1,8")."""
        try:
            sizes = tuple(int(b) for b in batch.split(","))
        except ValueError:
            raise KvbenchError(f"--batch '{batch}': comma-separated integers, e.g. 1,8") \
                from None
        return cls(tuple(models) or DEFAULT_MODELS, sizes, dtype, quick)


def _ladder(lo: int, hi: int, step: int) -> tuple[int, ...]:
    """lo, lo * step, ... below hi, then hi (lo alone when hi <= lo)."""
    out = [lo]
    while out[-1] * step < hi:
        out.append(out[-1] * step)
    return tuple([*out, hi] if hi > out[-1] else out)


@dataclass(frozen=True)
class Shapes:
    """The shapes one model is calibrated at, from its spec and the config."""

    spec: ModelSpec
    rows: tuple[int, ...]  # linear points' rows
    matmul: int  # the peak matmul's size
    tokens: tuple[int, ...]  # attention points' host tokens
    token_bytes: int  # K and V of one token of one layer, batch 1

    @classmethod
    def of(cls, spec: ModelSpec, cfg: CalibrateConfig, dtype: str) -> Shapes:
        elem = 4 if dtype == "float32" else 2
        token_bytes = 2 * spec.n_kv_heads * spec.head_dim * elem
        most = max(MIN_TOKENS, min(spec.ctx, KV_CAP // (token_bytes * max(cfg.batch))))
        rows = QUICK_ROWS if cfg.quick else DENSE_ROWS
        return cls(spec, tuple(sorted({*rows, *cfg.batch})),
                   int(model_params(spec)["peak_flops"]["n"]),
                   _ladder(MIN_TOKENS, most, 16 if cfg.quick else 4), token_bytes)


@dataclass(frozen=True)
class Step:
    """One probe run of a calibration: the probe's name, its config, what it measures."""

    probe: str
    config: Any
    what: str

    def command(self) -> str:
        """The `kvbench probe` command of this config (the options off their default)."""
        from kvbench.options import to_argv

        changed = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)
                   if getattr(self.config, f.name) != f.default}
        return shlex.join(["kvbench", "probe", self.probe, *to_argv(changed)])


def plan(cfg: CalibrateConfig, cuda: bool) -> list[Step]:
    """The probe runs of a calibration (the module docstring's table)."""
    from kvbench.probes.attention import AttentionConfig
    from kvbench.probes.bandwidth import BandwidthConfig
    from kvbench.probes.roofline import RooflineConfig
    from kvbench.probes.timer import TimerConfig
    from kvbench.timing import PASSES
    from kvbench.units import format_size

    min_time = 0.02 if cfg.quick else 0.2
    batch = ",".join(map(str, cfg.batch))
    dtype = cfg.accel_dtype(cuda)
    shapes = [Shapes.of(get_spec(m), cfg, dtype) for m in cfg.models]
    # the accelerator's dtype; with CUDA the CPU's peak stays float32 (the PNM role's)
    # and the GPU's matmul size the probe's (a model-sized one leaves tensor cores idle)
    devices = {"dtype": "float32", "cuda_dtype": dtype} if cuda else {"dtype": dtype}
    steps = [Step("timer", TimerConfig(calls=1000, reps=3) if cfg.quick else TimerConfig(),
                  "per-op overhead of small torch ops (launch cost)")]
    for s in shapes:
        sp = s.spec
        steps.append(Step("roofline", RooflineConfig(
            model=sp.name, tokens=ROOFLINE_TOKENS, matmul=s.matmul, min_time=min_time,
            linear_rows=",".join(map(str, s.rows)), **devices),
            f"{sp.name}: peak matmul {s.matmul}, memory GB/s, linear {sp.ffn}x{sp.hidden} at "
            f"rows {','.join(map(str, s.rows))}"))
        steps.append(Step("attention", AttentionConfig(
            batch=batch, heads=str(sp.n_heads), kv_heads=str(sp.n_kv_heads),
            head_dim=str(sp.head_dim), gpu_tokens=str(MIN_TOKENS),
            host_tokens=",".join(map(str, s.tokens)), query="1", dtype=dtype,
            modes="cpu-dense,cpu-sparse" + (",gpu" if cuda else ""), min_time=min_time,
            passes=2 if cfg.quick else PASSES),
            f"{sp.name}: decode at {sp.n_heads}/{sp.n_kv_heads} heads x {sp.head_dim}, "
            f"batch {batch}, host tokens {','.join(map(str, s.tokens))}"))
    low = min(s.token_bytes for s in shapes)
    lo = 1 << (low.bit_length() - 1)  # one token of one layer, down to a power of 2
    hi = max(min(KV_CAP, s.token_bytes * max(cfg.batch) * s.tokens[-1]) for s in shapes)
    sizes = _ladder(lo, max(hi, lo), 16 if cfg.quick else 4)
    memory = "both" if cuda else "pageable"
    for src, dst in [("host:0", "gpu:0"), ("gpu:0", "host:0")] if cuda else \
            [("host:0", "host:0")]:
        steps.append(Step("bandwidth", BandwidthConfig(
            src=src, dst=dst, memory=memory, sizes=",".join(map(format_size, sizes)),
            bars=False, quick=cfg.quick),
            f"{src} -> {dst} {memory}, {len(sizes)} sizes {format_size(sizes[0])}.."
            f"{format_size(sizes[-1])}"))
    return steps


def machine_key(env: dict[str, Any]) -> str:
    """12 hex digits over the fields of an environment record (kvbench.envinfo) that fix
    this machine's speeds (the module docstring)."""
    cpu = env.get("cpu") or {}
    ident = {"host": env.get("hostname"),
             "cpu": [cpu.get(k) for k in ("model", "arch", "logical_cpus", "physical_cores")],
             "caches": cpu.get("caches"),
             "memory_gib": round((env.get("memory_bytes") or 0) / (1 << 30)),
             "numa_nodes": len(env.get("numa_nodes") or []),
             "gpus": [g.get("name") for g in env.get("gpus") or []]}
    return hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]


def _machine(env: dict[str, Any]) -> str:
    cpu = env.get("cpu") or {}
    gpus = ", ".join(str(g.get("name")) for g in env.get("gpus") or [])
    return (f"host {env.get('hostname')}, {cpu.get('model')}, {cpu.get('logical_cpus')} "
            f"CPUs{', ' + gpus if gpus else ''}, key {machine_key(env)}")


def home() -> Path | None:
    """Where calibrations are stored: <cache>/calibration, <cache> being $KVBENCH_CACHE
    (default ~/.cache/kvbench, the weights cache's); None when KVBENCH_CACHE=off."""
    root = os.environ.get("KVBENCH_CACHE", "")
    if root == "off":
        return None
    return (Path(root) if root else Path.home() / ".cache" / "kvbench") / "calibration"


def command(models: Sequence[str], meta: dict[str, Any] | None = None) -> str:
    """The `kvbench calibrate` command for `models` (with a stored calibration's --batch,
    --dtype and --quick when they were not the defaults)."""
    args = ["kvbench", "calibrate"]
    for m in dict.fromkeys(models):
        args += ["--model", m]
    meta = meta or {}
    if tuple(meta.get("batch", DEFAULT_BATCH)) != DEFAULT_BATCH:
        args += ["--batch", ",".join(map(str, meta["batch"]))]
    if meta.get("dtype", "auto") != "auto":
        args += ["--dtype", meta["dtype"]]
    return shlex.join(args + (["--quick"] if meta.get("quick") else []))


def calibrate(cfg: CalibrateConfig, progress: Callable[[str], None] | None = None
              ) -> dict[str, Any]:
    """Run the plan's probes into a new folder and put it in place of this machine's
    calibration (an interrupted run leaves the previous one); returns its manifest."""
    import torch

    from kvbench import __version__
    from kvbench.envinfo import collect_env
    from kvbench.probes import PROBES, measure
    from kvbench.schema import now_iso
    from kvbench.store import ResultWriter

    where = home()
    require(where is not None, "KVBENCH_CACHE=off: kvbench calibrate stores its probes in "
            "the cache; set KVBENCH_CACHE to a folder (or unset it: ~/.cache/kvbench)")
    env = collect_env()
    key = machine_key(env)
    cuda = torch.cuda.is_available()
    steps = plan(cfg, cuda)
    part = where / f".{key}.part-{os.getpid()}"
    done, start, count = [], time.perf_counter(), 0
    try:
        with ResultWriter(part / RECORDS, env, "kvbench calibrate") as w:
            for i, step in enumerate(steps, 1):
                if progress is not None:
                    progress(f"{i}/{len(steps)} {step.probe}: {step.what}")
                t0, cmd, probe = time.perf_counter(), step.command(), PROBES.get(step.probe)
                for rec in measure(probe(), step.config):
                    rec.command = cmd
                    w.write(rec)
                done.append({"probe": step.probe, "version": probe.version, "what": step.what,
                             "command": cmd, "seconds": round(time.perf_counter() - t0, 1)})
            count = w.count
        meta = {"machine_key": key, "machine": _machine(env), "time": now_iso(),
                "models": list(cfg.models), "batch": list(cfg.batch), "dtype": cfg.dtype,
                "accel_dtype": cfg.accel_dtype(cuda), "quick": cfg.quick,
                "kvbench": __version__, "records": count,
                "seconds": round(time.perf_counter() - start, 1),
                "probes": done, "path": str(where / key / RECORDS)}
        (part / MANIFEST).write_text(json.dumps(meta, indent=1) + "\n")
        old = where / f".{key}.old-{os.getpid()}"
        if (where / key).exists():
            (where / key).rename(old)
        part.rename(where / key)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return meta


def show(meta: dict[str, Any]) -> None:
    """What a calibration stored: path, machine, probes with shapes and times, total time."""
    from kvbench.console import console

    console.print(f"calibration of this machine ({meta['machine']}): [cyan]{meta['path']}[/]",
                  soft_wrap=True)  # a path to copy, never broken across lines
    for p in meta["probes"]:
        console.print(f"  {p['probe']} v{p['version']} ({p['seconds']:.1f} s): {p['what']}")
    console.print(f"{meta['records']} records in {meta['seconds']:.0f} s"
                  f"{' (--quick)' if meta['quick'] else ''}; `kvbench project RESULTS "
                  "--hardware this` uses them")


def _manifest(folder: Path) -> dict[str, Any] | None:
    """A calibration's calibration.json; None when it is unreadable."""
    try:
        meta = json.loads((folder / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return meta if isinstance(meta, dict) and isinstance(meta.get("models"), list) else None


def stored(models: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The records of this machine's calibration for `models`; KvbenchError (one line,
    naming the command to run) when there is none, or it is of another machine, ran a
    probe version this kvbench no longer has, or lacks one of `models`."""
    from kvbench.envinfo import collect_env
    from kvbench.probes import PROBES
    from kvbench.store import load

    where = home()
    require(where is not None, "--hardware this: KVBENCH_CACHE=off turns off the cache "
            f"`{command(models)}` stores its calibration in: unset it, or pass --probes FILE")
    env = collect_env()
    folder = where / machine_key(env)
    if not (folder / MANIFEST).is_file():
        others = sorted((_manifest(d) or {}).get("machine", d.name)
                        for d in where.glob("*") if (d / MANIFEST).is_file())
        held = f"; it holds other machines' only ({'; '.join(others)})" if others else ""
        raise KvbenchError(f"--hardware this: no calibration of this machine ({_machine(env)}) "
                           f"in {where}{held}: run `{command(models)}` (or pass --probes FILE)")
    meta = _manifest(folder)
    require(meta is not None, f"--hardware this: the calibration in {folder} is damaged "
            f"({MANIFEST} unreadable): run `{command(models)}`")
    again = command([*meta["models"], *models], meta)
    rs = load(folder / RECORDS)
    for e in rs.envs.values():
        require(machine_key(e) == machine_key(env), f"--hardware this: the calibration in "
                f"{folder} is of another machine ({_machine(e)}), not this one "
                f"({_machine(env)}): run `{again}`")
    known = {p.name: p.version for p in PROBES.all()}
    for r in rs.records:
        require(known.get(r["name"]) == r.get("version"), f"--hardware this: the calibration "
                f"in {folder} is stale: its {r['name']} probe is version {r.get('version')}, "
                f"this kvbench's is {known.get(r['name'], 'gone')}: run `{again}`")
    missing = [m for m in models if m not in meta["models"]]
    require(not missing, f"--hardware this: the calibration in {folder} is for "
            f"{', '.join(meta['models'])}, not {', '.join(missing)}: run `{again}`")
    return rs.records
