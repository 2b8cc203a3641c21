"""`--hardware this`: a profile built from this machine's probe results.

Reads the records of `kvbench probe roofline` (peak FLOP/s and memory GB/s of the
accelerator role: cuda:0 when the probe saw one, else the CPU; its linear points give the
dense layers' GB/s over rows), `attention` (KV-read GB/s
against KV bytes: the accelerator's mode "gpu" or "cpu-dense", the host's "cpu-sparse"
then "cpu-dense"), `bandwidth` (the h2d and d2h curves: host:0 -> gpu:0 and back, pinned
and pageable, from the torch engine's records only, not `--engine cupy`'s; host:0 -> host:0
on a CPU-only machine, where the "copies" are memcpys) and
`timer` (op_overhead: per-launch cost). The PNM device role of pnm-kv and png-kv, which
kvbench runs on host memory and threads, is this machine's CPU: [pnm] takes the CPU's
roofline memory GB/s and peak, `shares_host` (its tasks take the host's time). Every
field's source names the probe record it came from. Power is left out (no probe measures
it): projected energy is then waived.

Probe records of several models (`kvbench calibrate --model A --model B`, or probe files of
several shapes) are told apart by `model_params`: given the model a projection is for,
`build` reads the peak matmul, linear and attention points measured at its shapes (all of
them where none match).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.hwmodel.profile import Profile
from kvbench.models import ModelSpec

HOW = {"roofline": "kvbench probe roofline --out FILE",
       "attention": "kvbench probe attention --modes cpu-dense,cpu-sparse --out FILE",
       "bandwidth": "kvbench probe bandwidth --out FILE",
       "timer": "kvbench probe timer --out FILE"}
MATMUL_CAP = 2048  # the peak matmul is the model's hidden size square, at most this: a
# larger one only runs longer (2 * 4096^3 FLOP takes seconds a call on a small CPU)


def model_params(spec: ModelSpec) -> dict[str, dict[str, Any]]:
    """Per metric, the params of the records measured at `spec`'s shapes: the peak matmul
    (n = hidden, capped), the MLP up-projection's linear points (roofline `shape`) and the
    attention points' head shape."""
    return {"peak_flops": {"n": min(spec.hidden, MATMUL_CAP)},
            "linear_gbps": {"shape": f"{spec.ffn}x{spec.hidden}"},
            "kv_read_gbps": {"heads": spec.n_heads, "kv_heads": spec.n_kv_heads,
                             "head_dim": spec.head_dim}}


def _pick(found: list[dict[str, Any]], want: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The records of `found` whose params match `want`; all of them where none does."""
    if not want:
        return found
    hit = [r for r in found if all(r["params"].get(k) == v for k, v in want.items())]
    return hit or found


def _ok(records: list[dict[str, Any]], probe: str, metric: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("kind") == "probe" and r.get("name") == probe
            and r.get("metric") == metric and r.get("status") == "ok"
            and r.get("value") is not None]


def _on(records: list[dict[str, Any]], metric: str, device: str) -> list[dict[str, Any]]:
    """The roofline probe's ok records of `metric` measured on `device`."""
    return [r for r in _ok(records, "roofline", metric) if r["params"].get("device") == device]


def _need(found: list[dict[str, Any]], probe: str, what: str) -> list[dict[str, Any]]:
    if not found:
        raise KvbenchError(f"--hardware this needs {what} from the {probe} probe of this "
                           f"machine: run `{HOW[probe]}` and pass --probes FILE")
    return found


def _src(r: dict[str, Any]) -> str:
    keep = {k: v for k, v in r["params"].items() if k in ("device", "src", "dst", "memory",
                                                           "mode", "dtype", "n", "rows")}
    return f"probe {r['name']} {r['metric']} {keep} ({r.get('time', '')}, env {r.get('env_id')})"


def _curve(found: list[dict[str, Any]], size_key: str) -> dict[str, list[float]]:
    by: dict[float, list[float]] = defaultdict(list)
    for r in found:
        by[float(r["params"][size_key])].append(float(r["value"]))
    sizes = sorted(by)
    return {"sizes": sizes, "gbps": [statistics.median(by[s]) for s in sizes]}


def build(records: list[dict[str, Any]], spec: ModelSpec | None = None) -> Profile:
    """The profile of the machine the probe records measured (the latest of each), at the
    shapes of `spec` where the records hold several (model_params)."""
    want = model_params(spec) if spec is not None else {}
    peak = _need(_ok(records, "roofline", "peak_flops"), "roofline", "peak_flops")
    dev = "cuda:0" if any(r["params"].get("device") == "cuda:0" for r in peak) else "cpu"
    gpu = dev != "cpu"
    peak = _pick(_on(records, "peak_flops", dev), want.get("peak_flops"))
    mem = _need(_on(records, "memory_gbps", dev), "roofline", "memory_gbps")
    ops = _need(_ok(records, "timer", "op_overhead"), "timer", "op_overhead")
    att = _pick(_ok(records, "attention", "kv_read_gbps"), want.get("kv_read_gbps"))
    acc_att = _need([r for r in att if r["params"].get("mode") == ("gpu" if gpu else
                                                                    "cpu-dense")],
                    "attention", "kv_read_gbps")
    host_att = [r for r in att if r["params"].get("mode") == "cpu-sparse"] or acc_att
    # the torch engine's copies only: --engine cupy's (the raw-CUDA reference) are not the
    # path kvbench's strategies copy through
    bw = [r for r in _ok(records, "bandwidth", "bandwidth")
          if r["params"].get("engine", "torch") == "torch"]
    links: dict[str, dict[str, Any]] = {}
    for link, (src, dst) in {"h2d": ("host:0", dev.replace("cuda", "gpu")),
                             "d2h": (dev.replace("cuda", "gpu"), "host:0")}.items():
        if not gpu:
            src = dst = "host:0"
        table: dict[str, Any] = {"source": {}}
        for memory in ("pinned", "pageable"):
            pts = [r for r in bw if r["params"].get("src") == src
                   and r["params"].get("dst") == dst and r["params"].get("memory") == memory]
            if pts:
                table[memory] = _curve(pts, "size")
                table["source"][memory] = _src(pts[0])
        if "pageable" not in table:
            _need([], "bandwidth", f"a {src} -> {dst} pageable curve")
        links[link] = table
    flops = {r["params"].get("dtype", "float32"): r["value"] for r in peak}
    lin = _pick(_on(records, "linear_gbps", dev), want.get("linear_gbps"))
    op = {r["params"].get("device"): r for r in ops}
    acc_op = op.get(dev) or ops[0]
    host_op = op.get("cpu") or ops[0]
    tables = {
        "accel": {"name": f"this machine's {dev}", "memory_gbps": mem[-1]["value"],
                  "peak_tflops": flops, "attention_gbps": _curve(acc_att, "kv_bytes"),
                  "launch_us": acc_op["value"], "shares_host": not gpu, "efficiency": 1.0,
                  "source": {"memory_gbps": _src(mem[-1]), "peak_tflops": _src(peak[-1]),
                             "attention_gbps": _src(acc_att[0]) + " by kv_bytes",
                             "launch_us": _src(acc_op),
                             "shares_host": "no GPU: the accelerator role is the CPU"
                             if not gpu else "a CUDA GPU",
                             "efficiency": "1: probe rates are achieved rates"}},
        "host": {"attention_gbps": _curve(host_att, "kv_bytes"), "launch_us": host_op["value"],
                 "source": {"attention_gbps": _src(host_att[0]) + " by kv_bytes",
                            "launch_us": _src(host_op)}},
        **links,
    }
    cpu_mem = _on(records, "memory_gbps", "cpu")
    cpu_peak = [r for r in _pick(_on(records, "peak_flops", "cpu"), want.get("peak_flops"))
                if r["params"].get("dtype", "float32") == "float32"]
    if cpu_mem and cpu_peak:
        tables["pnm"] = {"name": "this machine's CPU in the PNM device role",
                         "memory_gbps": cpu_mem[-1]["value"],
                         "peak_tflops": cpu_peak[-1]["value"], "shares_host": True,
                         "source": {"memory_gbps": _src(cpu_mem[-1]),
                                    "peak_tflops": _src(cpu_peak[-1]),
                                    "shares_host": "kvbench runs the PNM role on host "
                                                   "memory and threads"}}
    if lin:
        tables["accel"]["dense_gbps"] = _curve(lin, "rows")
        tables["accel"]["source"]["dense_gbps"] = _src(lin[0]) + " by rows"
    return Profile("this", tables, "probe records")
