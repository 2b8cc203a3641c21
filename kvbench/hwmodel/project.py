"""`kvbench project`: every run of a result file re-timed on hardware profiles.

For each run (its "trace.tasks" records, trace version 2: kvbench.runtime.trace) and each
profile, the scheduler (kvbench.hwmodel.schedule) gives the prefill and every decode step;
the records written are `provenance: "projected"`, params = the source run's plus
`hardware`, method naming the profile (and its file), the source run (command, time,
environment) and what is carried over unmodelled. Metrics: ttft, tbt (per-step samples),
decode_tokens_per_s, accel_idle_share, carried_share (the share of a step's projected
time that is measured seconds carried over, not modelled), link_seconds_per_step and
link_bytes_per_step
(where = h2d/d2h/cxl), and when the profile has power figures energy_per_token (J/token:
sum over devices of idle power over the decode time plus (peak - idle) over each
device's busy time, divided by the tokens) and, with a price, tokens_per_usd.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from kvbench.errors import KvbenchError, require
from kvbench.hwmodel.profile import Profile
from kvbench.hwmodel.scale import Shape, scale
from kvbench.hwmodel.schedule import StepTime, Timer, schedule, tasks_of
from kvbench.runtime.trace import TRACE_VERSION
from kvbench.schema import Record, measured, not_measured

CARRIED = ("bookkeeping seconds without a work model (host tasks of measured time) are "
           "carried over as measured on the source machine, and so is a CPU run's per-step "
           "dispatch (Python and small torch ops) onto a profile whose accelerator is the "
           "host CPU; the strategy's selections (tokens attended, bytes moved) are the "
           "source run's")
DROPPED = ("bookkeeping without a work model dropped (--bookkeeping none); the "
           "strategy's selections are the source run's")
RUN_CMD = "kvbench run STRATEGY --out FILE"


def runs(records: list[dict[str, Any]], path: str) -> dict[tuple, list[dict[str, Any]]]:
    """trace.tasks records grouped by source run; KvbenchError for no or an old trace."""
    out: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    old = False
    for r in records:
        if r.get("kind") != "run" or not str(r.get("metric", "")).startswith("trace."):
            continue
        if r["metric"] != "trace.tasks":
            old = True
            continue
        version = r.get("method", {}).get("trace_version")
        require(version == TRACE_VERSION, f"{path}: trace version {version}; kvbench project "
                f"reads version {TRACE_VERSION}: re-run with `{RUN_CMD}`")
        p = {k: v for k, v in r["params"].items() if k not in ("step", "phase")}
        key = (r["name"], r.get("command", ""), tuple(sorted((k, repr(v))
                                                            for k, v in p.items())))
        out[key].append(r)
    if not out:
        if old:
            raise KvbenchError(f"{path}: an older trace (per-quantity counters, version 1) "
                               f"without the stage graph kvbench project needs: re-run with "
                               f"`{RUN_CMD}`")
        raise KvbenchError(f"{path}: no run trace to project (make one with `{RUN_CMD}`)")
    return out


def source_shape(params: dict[str, Any]) -> Shape:
    from kvbench.models import get_spec

    dtype = str(params.get("dtype", "float32"))
    return Shape(get_spec(str(params["model"])), int(params["batch"]),
                 int(params["prompt_len"]), int(params["gen_len"]),
                 {"float32": 4, "float64": 8}.get(dtype, 2))


def project_run(recs: list[dict[str, Any]], prof: Profile, memory: str,
                target: Shape | None = None, carried: bool = True, skip: int = 0
                ) -> tuple[StepTime, list[StepTime]]:
    """(prefill, decode steps after the first `skip`) of one run on one profile (scaled to
    `target` if given)."""
    first = recs[0]
    dtype = str(first["params"].get("dtype", "float32"))
    if target is not None:
        dtype = {4: "float32"}.get(target.elem, "float16")
    tasks = []
    for r in recs:
        m = r["method"]
        tasks += tasks_of(m["tasks"], m["columns"], int(r["params"]["step"]))
    timer = Timer(prof, dtype, memory, carried, any(t.op == "dispatch" for t in tasks))
    if target is not None:
        tasks = scale(tasks, source_shape(first["params"]), target)
    steps = schedule(tasks, timer)
    pre = next((s for s in steps if s.step == 0), StepTime(0))
    return pre, [s for s in steps if s.step > skip]


def records(recs: list[dict[str, Any]], prof: Profile, memory: str,
            target: Shape | None = None, carried: bool = True, skip: int = 0
            ) -> Iterator[Record]:
    """The projected records of one run on one profile (on `target`'s shape if given),
    decode metrics over the steps after the first `skip` (warm-up: a pool filled at
    step 1)."""
    first = recs[0]
    name = first["name"]
    params = {k: v for k, v in first["params"].items() if k not in ("step", "phase")}
    params["hardware"] = prof.name
    params["bookkeeping"] = "measured" if carried else "none"  # --bookkeeping
    reps = prof.tables.get("replicas")
    if reps:
        params.update(gpus=reps["gpus"], pnms=reps["pnms"])
    scaled = {}
    if target is not None:
        src = source_shape(params)
        scaled = {"scaled_from": f"{src.spec.name} ({params.get('layers')} layers), batch "
                  f"{src.batch}, prompt {src.prompt}, {src.gen} steps, {params.get('dtype')}; "
                  "the strategy's selection statistics (share of the context attended and "
                  "moved per step and layer) carried over (kvbench.hwmodel.scale)"}
        params.update({"model": target.spec.name, "layers": target.spec.n_layers,
                       "layers_total": target.spec.n_layers, "batch": target.batch,
                       "prompt_len": target.prompt, "gen_len": target.gen,
                       "dtype": {4: "float32"}.get(target.elem, "float16"),
                       "weights": "projected"})
    pre, dec = project_run(recs, prof, memory, target, carried, skip)
    require(bool(dec), f"run {name} has no decode step in its trace")
    batch = int(params.get("batch", 1))  # type: ignore[arg-type]
    method = {"profile": prof.name, "profile_file": prof.path, "host_memory": memory,
              "source_run": first.get("command", ""), "source_time": first.get("time", ""),
              "source_env": first.get("env_id", ""), "trace_version": TRACE_VERSION,
              "carried_over": CARRIED if carried else DROPPED, "skipped_steps": skip,
              "model": "kvbench.hwmodel.schedule", **scaled}

    def rec(metric: str, unit: str, direction: str, samples: list[float],
            extra: dict[str, Any] | None = None) -> Record:
        r = measured("run", name, metric, unit, direction, samples,  # type: ignore[arg-type]
                     {**params, **(extra or {})}, method, str(first.get("version", "1")))
        r.provenance = "projected"
        return r

    times = [s.seconds for s in dec]
    yield rec("ttft", "s", "lower", [pre.seconds])
    yield rec("tbt", "s", "lower", times)
    yield rec("decode_tokens_per_s", "tokens/s", "higher", [batch / t for t in times if t])
    total = sum(times)
    busy = sum(s.busy.get("accel", 0.0) for s in dec)
    yield rec("accel_idle_share", "ratio", "lower", [max(0.0, 1 - busy / total)])
    # how much of the projection is measured time carried over rather than modelled
    yield rec("carried_share", "ratio", "none",
              [s.carried / s.seconds for s in dec if s.seconds] or [0.0])
    for link in ("h2d", "d2h", "cxl"):
        if any(s.moved.get(link) for s in dec):
            yield rec("link_seconds_per_step", "s", "none", [s.busy.get(link, 0.0) for s in dec],
                      {"where": link})
            yield rec("link_bytes_per_step", "B", "none", [s.moved.get(link, 0.0) for s in dec],
                      {"where": link})
    yield from _energy(rec, prof, dec, batch, name, params)


def _energy(rec: Any, prof: Profile, dec: list[StepTime], batch: int, name: str,
            params: dict[str, Any]) -> Iterator[Record]:
    power = prof.tables.get("power", {})
    host = prof.tables.get("host", {})
    if "accel_peak_w" not in power:
        r = not_measured("run", name, "energy_per_token", "waived",
                         f"hardware profile '{prof.name}' has no power figures", params)
        r.provenance = "projected"
        yield r
        return
    total = sum(s.seconds for s in dec)
    devices = [("accel", power.get("accel_idle_w", 0.0), power["accel_peak_w"]),
               ("host", host.get("idle_w", 0.0), host.get("peak_w", 0.0))]
    if "pnm_peak_w" in power:
        devices.append(("pnm", power.get("pnm_idle_w", 0.0), power["pnm_peak_w"]))
    joules = sum(idle * total + (peak - idle) * sum(s.busy.get(d, 0.0) for s in dec)
                 for d, idle, peak in devices)
    tokens = batch * len(dec)
    yield rec("energy_per_token", "J/token", "lower", [joules / tokens],
              {"energy_devices": ",".join(d for d, _, _ in devices)})
    price = prof.tables.get("price", {})
    if "usd_per_hour" in price:
        usd = (price["usd_per_hour"] + price.get("pnm_usd_per_hour", 0.0)) * total / 3600
        yield rec("tokens_per_usd", "tokens/$", "higher", [tokens / usd])
