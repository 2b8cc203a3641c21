"""`--hardware this`: a profile built from this machine's probe results.

Reads the records of `kvbench probe roofline` (peak FLOP/s and memory GB/s of the
accelerator role: cuda:0 when the probe saw one, else the CPU; its linear points give the
dense layers' GB/s over rows), `attention` (KV-read GB/s
against KV bytes: the accelerator's mode "gpu" or "cpu-dense", the host's "cpu-sparse"
then "cpu-dense"), `bandwidth` (the h2d and d2h curves: host:0 -> gpu:0 and back, pinned
and pageable; host:0 -> host:0 on a CPU-only machine, where the "copies" are memcpys) and
`timer` (op_overhead: per-launch cost). The PNM device role of pnm-kv and png-kv, which
kvbench runs on host memory and threads, is this machine's CPU: [pnm] takes the CPU's
roofline memory GB/s and peak, `shares_host` (its tasks take the host's time). Every
field's source names the probe record it came from. Power is left out (no probe measures
it): projected energy is then waived.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.hwmodel.profile import Profile

HOW = {"roofline": "kvbench probe roofline --out FILE",
       "attention": "kvbench probe attention --modes cpu-dense,cpu-sparse --out FILE",
       "bandwidth": "kvbench probe bandwidth --out FILE",
       "timer": "kvbench probe timer --out FILE"}


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


def build(records: list[dict[str, Any]]) -> Profile:
    """The profile of the machine the probe records measured (the latest of each)."""
    peak = _need(_ok(records, "roofline", "peak_flops"), "roofline", "peak_flops")
    dev = "cuda:0" if any(r["params"].get("device") == "cuda:0" for r in peak) else "cpu"
    gpu = dev != "cpu"
    peak = _on(records, "peak_flops", dev)
    mem = _need(_on(records, "memory_gbps", dev), "roofline", "memory_gbps")
    ops = _need(_ok(records, "timer", "op_overhead"), "timer", "op_overhead")
    att = _ok(records, "attention", "kv_read_gbps")
    acc_att = _need([r for r in att if r["params"].get("mode") == ("gpu" if gpu else
                                                                    "cpu-dense")],
                    "attention", "kv_read_gbps")
    host_att = [r for r in att if r["params"].get("mode") == "cpu-sparse"] or acc_att
    bw = _ok(records, "bandwidth", "bandwidth")
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
    lin = _on(records, "linear_gbps", dev)
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
    cpu_peak = [r for r in _on(records, "peak_flops", "cpu")
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
