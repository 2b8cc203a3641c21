"""`kvbench project`'s records, every metric computed by hand in the test (issue 30): a run of
four steps whose stage graph is one accelerator computation, then one pageable H2D copy, then
one host task of measured seconds, each waiting for the one before (the first for the last
of the step before), so a step's time is the sum of the three and each resource's busy time
is its own task's."""

from __future__ import annotations

import math

import pytest
from conftest import trace_row

from kvbench.errors import KvbenchError
from kvbench.hwmodel import project
from kvbench.hwmodel.profile import parse, replicate
from kvbench.hwmodel.scale import Shape
from kvbench.models import get_spec
from kvbench.runtime.trace import COLUMNS, TRACE_VERSION

# per step (0 is the prefill): accelerator FLOPs at 1 TFLOP/s, H2D bytes at 5 GB/s, host s
WORK_OF = {0: (2e9, 1e7, 1e-3), 1: (1e9, 5e6, 2e-3), 2: (3e9, 1.5e7, 0.5e-3),
           3: (1e9, 1e7, 1e-3)}
MS = {s: (f / 1e12, m / 5e9, c) for s, (f, m, c) in WORK_OF.items()}  # seconds of each
PROFILE = {"name": "mine",
           "accel": {"memory_gbps": 100.0, "peak_tflops": 1.0, "attention_gbps": 50.0,
                     "launch_us": 1.0},
           "host": {"attention_gbps": 10.0, "launch_us": 2.0, "idle_w": 5.0, "peak_w": 25.0},
           "h2d": {"pageable": 5.0, "pinned": 10.0}, "d2h": {"pageable": 5.0, "pinned": 10.0},
           "power": {"accel_idle_w": 10.0, "accel_peak_w": 110.0, "pnm_idle_w": 1.0,
                     "pnm_peak_w": 3.0},
           "price": {"usd_per_hour": 3.6, "pnm_usd_per_hour": 0.36}}
PARAMS = {"model": "smollm2-135m", "layers": 30, "batch": 2, "prompt_len": 16, "gen_len": 3,
          "dtype": "float32"}
UNITS = {"ttft": ("s", "lower"), "tbt": ("s", "lower"),
         "decode_tokens_per_s": ("tokens/s", "higher"), "accel_idle_share": ("ratio", "lower"),
         "carried_share": ("ratio", "none"), "link_seconds_per_step": ("s", "none"),
         "link_bytes_per_step": ("B", "none"), "energy_per_token": ("J/token", "lower"),
         "tokens_per_usd": ("tokens/$", "higher")}


def _trace(name: str = "quest", command: str = "kvbench run quest", **params: object
           ) -> list[dict]:
    """The run's trace.tasks records, one per step, ids unique across steps."""
    out = []
    for step, (f, m, c) in WORK_OF.items():
        i = 10 * step
        rows = [trace_row(i, "accel", "head", [i - 8] if step else [], flops=f),  # after the last
                trace_row(i + 1, "h2d", "copy", [i], bytes_moved=m, copies=1.0),
                trace_row(i + 2, "host", "bookkeeping", [i + 1], seconds=c)]
        out.append({"schema_version": 1, "kind": "run", "name": name, "metric": "trace.tasks",
                    "unit": "tasks", "direction": "none", "status": "ok", "value": 1.0,
                    "provenance": "measured", "command": command, "time": "t0",
                    "env_id": "e0", "version": "2",
                    "params": {**PARAMS, **params, "step": step},
                    "method": {"trace_version": TRACE_VERSION, "columns": list(COLUMNS),
                               "tasks": rows}})
    return out


def _by_metric(recs: list) -> dict[tuple[str, str | None], object]:
    out = {}
    for r in recs:
        key = (r.metric, r.params.get("where"))
        assert key not in out, key
        out[key] = r
    return out


@pytest.mark.parametrize("skip", [0, 1])
def test_every_projected_metric_equals_its_hand_computation(skip: int) -> None:
    prof = parse(PROFILE, "p.toml")
    recs = list(project.records(_trace(), prof, "pageable", skip=skip))
    got = _by_metric(recs)
    steps = [s for s in (1, 2, 3) if s > skip]
    t = {s: sum(MS[s]) for s in MS}
    total = sum(t[s] for s in steps)
    busy_accel, busy_host = sum(MS[s][0] for s in steps), sum(MS[s][2] for s in steps)
    tokens = 2 * len(steps)
    want = {
        ("ttft", None): [t[0]],
        ("tbt", None): [t[s] for s in steps],
        ("decode_tokens_per_s", None): [2 / t[s] for s in steps],
        ("accel_idle_share", None): [1 - busy_accel / total],
        ("carried_share", None): [MS[s][2] / t[s] for s in steps],
        ("link_seconds_per_step", "h2d"): [MS[s][1] for s in steps],
        ("link_bytes_per_step", "h2d"): [WORK_OF[s][1] for s in steps],
        ("energy_per_token", None): [(10 * total + 100 * busy_accel + 5 * total
                                      + 20 * busy_host + 1 * total) / tokens],
        ("tokens_per_usd", None): [tokens / ((3.6 + 0.36) * total / 3600)],
    }
    assert set(got) == set(want)  # no d2h or cxl rows: nothing moved there
    for key, samples in want.items():
        r = got[key]
        assert r.samples == pytest.approx(samples, rel=1e-9), key
        assert (r.kind, r.name, r.unit, r.direction) == ("run", "quest", *UNITS[key[0]]), key
        assert r.provenance == "projected" and r.version == "2", key
        assert r.params == {**PARAMS, "hardware": "mine", "bookkeeping": "measured",
                            **({"where": "h2d"} if key[1] else {}),
                            **({"energy_devices": "accel,host,pnm"}
                               if key[0] == "energy_per_token" else {})}, key
    m = got[("tbt", None)].method
    assert m["profile"] == "mine" and m["profile_file"] == "p.toml"
    assert m["host_memory"] == "pageable" and m["skipped_steps"] == skip
    assert (m["source_run"], m["source_time"], m["source_env"]) == ("kvbench run quest",
                                                                    "t0", "e0")
    assert m["carried_over"] == project.CARRIED and m["trace_version"] == TRACE_VERSION
    assert m["model"] == "kvbench.hwmodel.schedule"


def test_dropped_bookkeeping_replicas_and_a_profile_without_power() -> None:
    """--bookkeeping none leaves the host seconds out; 2 GPUs halve the accelerator's and
    the links' times and double their power and price; no power: energy waived."""
    base = parse(PROFILE, "p.toml")
    got = _by_metric(list(project.records(_trace(), base, "pageable", carried=False)))
    assert got[("tbt", None)].samples == pytest.approx([MS[s][0] + MS[s][1] for s in (1, 2, 3)])
    assert got[("carried_share", None)].samples == [0.0, 0.0, 0.0]
    assert got[("tbt", None)].method["carried_over"] == project.DROPPED
    assert got[("tbt", None)].params["bookkeeping"] == "none"

    two = replicate(base, 2, 1)
    got = _by_metric(list(project.records(_trace(), two, "pageable")))
    tbt = [MS[s][0] / 2 + MS[s][1] / 2 + MS[s][2] for s in (1, 2, 3)]
    assert got[("tbt", None)].samples == pytest.approx(tbt)
    assert got[("tbt", None)].params["hardware"] == "mine:2gpu+1pnm"
    assert (got[("tbt", None)].params["gpus"], got[("tbt", None)].params["pnms"]) == (2, 1)
    total, accel = sum(tbt), sum(MS[s][0] / 2 for s in (1, 2, 3))
    host = sum(MS[s][2] for s in (1, 2, 3))
    joules = 20 * total + 200 * accel + 5 * total + 20 * host + 1 * total
    assert got[("energy_per_token", None)].value == pytest.approx(joules / 6)
    assert got[("tokens_per_usd", None)].value == pytest.approx(6 / ((7.2 + 0.36) * total
                                                                     / 3600))

    bare = parse({k: v for k, v in PROFILE.items() if k not in ("power", "price")}, "b.toml")
    got = _by_metric(list(project.records(_trace(), bare, "pageable")))
    energy = got[("energy_per_token", None)]
    assert energy.status == "waived" and energy.provenance == "projected"
    assert (energy.name, energy.reason) == ("quest", "hardware profile 'mine' has no power "
                                                     "figures")
    assert energy.params == {**PARAMS, "hardware": "mine", "bookkeeping": "measured"}
    assert ("tokens_per_usd", None) not in got

    # only peak powers and a GPU price: idle draws and the PNM's price count as 0
    sparse = parse({**{k: v for k, v in PROFILE.items() if k not in ("power", "price")},
                    "host": {"attention_gbps": 10.0, "launch_us": 2.0},
                    "power": {"accel_peak_w": 110.0, "pnm_peak_w": 3.0},
                    "price": {"usd_per_hour": 3.6}}, "s.toml")
    got = _by_metric(list(project.records(_trace(), sparse, "pageable")))
    total, accel = sum(sum(MS[s]) for s in (1, 2, 3)), sum(MS[s][0] for s in (1, 2, 3))
    assert got[("energy_per_token", None)].value == pytest.approx(110 * accel / 6)
    assert got[("tokens_per_usd", None)].value == pytest.approx(6 / (3.6 * total / 3600))


def test_a_scaled_projection_is_labelled_with_its_target_and_source() -> None:
    prof = parse(PROFILE, "p.toml")
    target = Shape(get_spec("llama-2-7b"), 8, 2048, 64, 2)
    got = _by_metric(list(project.records(_trace(), prof, "pinned", target)))
    p = got[("tbt", None)].params
    assert {k: p[k] for k in ("model", "layers", "layers_total", "batch", "prompt_len",
                              "gen_len", "dtype", "weights")} == {
        "model": "llama-2-7b", "layers": 32, "layers_total": 32, "batch": 8,
        "prompt_len": 2048, "gen_len": 64, "dtype": "float16", "weights": "projected"}
    assert got[("tbt", None)].method["scaled_from"] == (
        "smollm2-135m (30 layers), batch 2, prompt 16, 3 steps, float32; the strategy's "
        "selection statistics (share of the context attended and moved per step and layer) "
        "carried over (kvbench.hwmodel.scale)")
    assert got[("tbt", None)].method["host_memory"] == "pinned"
    assert got[("decode_tokens_per_s", None)].samples == pytest.approx(
        [8 / x for x in got[("tbt", None)].samples])
    assert project.source_shape({**PARAMS, "dtype": "bfloat16"}).elem == 2
    assert project.source_shape({**PARAMS, "dtype": "float64"}).elem == 8
    assert project.source_shape(PARAMS) == Shape(get_spec("smollm2-135m"), 2, 16, 3, 4)


def test_runs_group_by_strategy_command_and_params_not_step() -> None:
    other = {**_trace()[0], "metric": "tbt"}  # not a trace: skipped, the rest still read
    probe = {**_trace()[0], "kind": "probe"}
    phased = [{**r, "params": {**r["params"], "phase": "decode"}} for r in _trace()]
    recs = [other, probe, *_trace(), *_trace(batch=4), *_trace("hgca", "kvbench run hgca"),
            *_trace(command="kvbench run quest --again"), *phased]
    grouped = project.runs(recs, "f.jsonl")
    # the phased run is the first one (step and phase are not part of a run's identity);
    # the same parameters under another command are another run
    assert sorted(len(v) for v in grouped.values()) == [4, 4, 4, 8]
    assert sorted(k[:2] for k in grouped) == [
        ("hgca", "kvbench run hgca"), ("quest", "kvbench run quest"),
        ("quest", "kvbench run quest"), ("quest", "kvbench run quest --again")]
    assert all({r["params"]["step"] for r in v} == {0, 1, 2, 3} for v in grouped.values())

    base = _trace()[0]
    old = [{**base, "metric": "trace.time"}]
    with pytest.raises(KvbenchError, match=r"f\.jsonl: an older trace .* re-run with "
                                           r"`kvbench run STRATEGY --out FILE`"):
        project.runs(old, "f.jsonl")
    with pytest.raises(KvbenchError, match=r"f\.jsonl: no run trace to project"):
        project.runs([probe], "f.jsonl")
    stale = [{**base, "method": {**base["method"], "trace_version": 1}}]
    with pytest.raises(KvbenchError, match=rf"f\.jsonl: trace version 1; kvbench project "
                                           rf"reads version {TRACE_VERSION}"):
        project.runs(stale, "f.jsonl")


def test_project_run_skips_steps_and_reads_every_records_tasks() -> None:
    prof = parse(PROFILE, "p.toml")
    pre, dec = project.project_run(_trace(), prof, "pageable", skip=2)
    assert pre.step == 0 and pre.seconds == pytest.approx(sum(MS[0]))
    assert [s.step for s in dec] == [3] and dec[0].seconds == pytest.approx(sum(MS[3]))
    assert math.isclose(dec[0].moved["h2d"], WORK_OF[3][1])


def test_memory_kind_dtype_and_target_shape_reach_the_timer() -> None:
    """Pinned copies at the profile's pinned rate; a float16 run at the float16 peak; a
    scaled target of 4-byte elements labelled float32."""
    prof = parse({**PROFILE, "accel": {**PROFILE["accel"],
                                       "peak_tflops": {"float32": 1.0, "float16": 2.0}}}, "p")
    got = _by_metric(list(project.records(_trace(), prof, "pinned")))
    assert got[("tbt", None)].samples == pytest.approx(
        [MS[s][0] + MS[s][1] / 2 + MS[s][2] for s in (1, 2, 3)])  # 10 GB/s pinned
    assert got[("tbt", None)].method["host_memory"] == "pinned"
    half = _by_metric(list(project.records(_trace(dtype="float16"), prof, "pageable")))
    assert half[("tbt", None)].samples == pytest.approx(
        [MS[s][0] / 2 + MS[s][1] + MS[s][2] for s in (1, 2, 3)])
    got = _by_metric(list(project.records(_trace(), prof, "pageable",
                                          Shape(get_spec("llama-2-7b"), 8, 64, 3, 4))))
    assert got[("tbt", None)].params["dtype"] == "float32"
    unscaled = [sum(MS[s]) for s in (1, 2, 3)]
    assert got[("tbt", None)].samples != pytest.approx(unscaled)  # the target's graph ran


def test_links_without_a_copy_in_some_steps() -> None:
    """A D2H copy in step 2 only and a CXL read in steps 1 and 3: each link's records name
    it, with 0 for the steps it was idle."""
    recs = _trace()
    for r in recs:
        step = r["params"]["step"]
        i = 10 * step
        if step == 2:
            r["method"]["tasks"].append(trace_row(i + 3, "d2h", "copy", [i + 2], bytes_moved=5e6,
                                             copies=1.0))
        if step in (1, 3):
            r["method"]["tasks"].append(trace_row(i + 4, "cxl", "read", [i + 2], bytes_moved=2e7,
                                             copies=1.0))
    prof = parse({**PROFILE, "cxl": {"pageable": 20.0}}, "p")
    got = _by_metric(list(project.records(recs, prof, "pageable")))
    assert got[("link_bytes_per_step", "d2h")].samples == [0.0, 5e6, 0.0]
    assert got[("link_seconds_per_step", "d2h")].samples == pytest.approx([0.0, 1e-3, 0.0])
    assert got[("link_bytes_per_step", "cxl")].samples == [2e7, 0.0, 2e7]
    assert got[("link_seconds_per_step", "cxl")].samples == pytest.approx([1e-3, 0.0, 1e-3])


def test_a_trace_without_prefill_or_decode() -> None:
    prof = parse(PROFILE, "p.toml")
    pre, dec = project.project_run(_trace()[1:], prof, "pageable")
    assert (pre.step, pre.seconds) == (0, 0.0) and [s.step for s in dec] == [1, 2, 3]
    with pytest.raises(KvbenchError, match=r"^run quest has no decode step in its trace$"):
        list(project.records(_trace()[:1], prof, "pageable"))
    assert project.source_shape({k: v for k, v in PARAMS.items() if k != "dtype"}).elem == 4
    phased = [{**r, "params": {**r["params"], "phase": "decode"}} for r in _trace()]
    got = _by_metric(list(project.records(phased, prof, "pageable")))
    assert "phase" not in got[("tbt", None)].params  # a step's label, not the run's
    # an older trace record before the run's tasks does not hide them
    older = {**_trace()[0], "metric": "trace.time"}
    assert [len(v) for v in project.runs([older, *_trace()], "f").values()] == [4]
