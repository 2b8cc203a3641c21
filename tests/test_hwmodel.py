"""Hardware profiles, the scheduler and `kvbench project` (issue 14)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_usage_error, cli, trace_row

from kvbench.cli import main
from kvbench.hwmodel.profile import Curve, load, names, parse, rows
from kvbench.hwmodel.schedule import Task, Timer, schedule
from kvbench.runtime.trace import COLUMNS

SHIPPED = ["h100-sxm", "h100-pcie", "h200", "a100-80gb-pcie4", "a6000-pcie4", "a6000-pcie3",
           "l40s", "rtx4090", "a100-pnm"]


def test_every_shipped_profile_is_complete_and_cites_each_field() -> None:
    assert sorted(SHIPPED) == names()
    for name in names():
        p = load(name).check()
        missing = [f for f, _, src in rows(p) if not src and not f.endswith("description")]
        assert not missing, f"{name}: fields without a source: {missing}"
        assert p.get("power", "accel_peak_w") and p.get("host", "peak_w")
        assert p.get("price", "usd_per_hour")
    pnm = load("a100-pnm")
    assert (pnm.get("pnm", "memory_gbps"), pnm.get("pnm", "peak_tflops"),
            pnm.get("pnm", "memory_gib")) == (1100, 8.0, 512)  # CXL-PNM Table 2


def test_curve_from_peak_and_latency_and_log_interpolation() -> None:
    c = Curve.of({"peak_gbps": 25.0, "latency_us": 10.0}, "t")
    # a 1 MiB copy: 10 us + 1048576 B / 25e9 B/s
    assert c.seconds(1 << 20) == pytest.approx(10e-6 + (1 << 20) / 25e9, rel=1e-9)
    m = Curve.of({"sizes": [1024, 4096], "gbps": [1.0, 3.0]}, "t")
    assert m.at(2048) == pytest.approx(2.0)  # halfway in log size
    assert m.at(1) == 1.0 and m.at(1 << 30) == 3.0  # flat beyond the ends
    # four copies of 1 KiB each run at the 1 KiB rate, not the 4 KiB one
    assert m.seconds(4096, copies=4) == pytest.approx(4096 / 1e9)


def _profile(shares_host: bool = False) -> object:
    return parse({"name": "t",
                  "accel": {"memory_gbps": 100.0, "peak_tflops": {"float32": 1.0},
                            "attention_gbps": 50.0, "launch_us": 1.0,
                            "shares_host": shares_host},
                  "host": {"attention_gbps": 10.0, "launch_us": 2.0},
                  "h2d": {"pageable": 5.0}, "d2h": {"pageable": 5.0}}).check()


def _task(i: int, res: str, op: str, after: list[int], step: int = 1, bg: bool = False,
          **work: float) -> Task:
    return Task(i, step, 0, res, op, work, after, bg)


def test_schedule_overlaps_forks_and_serialises_a_shared_host() -> None:
    dense = {"flops": 2e9, "bytes_read": 1e8, "launches": 10.0}  # 2 ms compute > 1 ms bytes
    graph = [_task(0, "accel", "pre", [], **dense),
             _task(1, "host", "attention", [0], bytes_read=3e7),  # 3 ms on the host
             _task(2, "accel", "attention", [0], bytes_read=1e8),  # 2 ms on the accel
             _task(3, "accel", "post", [1, 2], **dense)]
    pre = 2e-3 + 10e-6
    host = 3e-3
    alone = schedule(graph, Timer(_profile(), "float32", "pageable"))[0].seconds
    assert alone == pytest.approx(pre + max(host, 2e-3) + pre)  # host beside the accel
    shared = schedule(graph, Timer(_profile(True), "float32", "pageable"))[0].seconds
    assert shared == pytest.approx(pre + host + 2e-3 + pre)  # one CPU does both


def test_dispatch_is_carried_onto_a_cpu_accelerator_only_and_replaces_launches() -> None:
    dense = {"flops": 2e9, "launches": 10.0}  # 2 ms compute + 10 launches
    graph = [_task(0, "accel", "pre", [], **dense),
             _task(1, "host", "dispatch", [0], seconds=5e-3)]
    cpu = Timer(_profile(True), "float32", "pageable", dispatch=True)
    assert schedule(graph, cpu)[0].seconds == pytest.approx(2e-3 + 5e-3)  # no launch cost
    gpu = Timer(_profile(False), "float32", "pageable", dispatch=True)
    assert schedule(graph, gpu)[0].seconds == pytest.approx(2e-3 + 10e-6)  # launches only
    dropped = Timer(_profile(True), "float32", "pageable", carried=False, dispatch=True)
    assert schedule(graph, dropped)[0].seconds == pytest.approx(2e-3)


def test_background_work_delays_the_next_step_only_through_its_resource() -> None:
    graph = [_task(0, "accel", "pre", [], flops=1e9),  # 1 ms
             _task(1, "d2h", "copy", [0], bg=True, bytes_moved=5e7),  # 10 ms, in background
             _task(2, "accel", "pre", [0], step=2, flops=1e9),
             _task(3, "d2h", "copy", [2], step=2, bytes_moved=5e6)]  # waits for the engine
    steps = schedule(graph, Timer(_profile(), "float32", "pageable"))
    assert steps[0].seconds == pytest.approx(1e-3)
    assert steps[1].seconds == pytest.approx(11e-3)  # the engine is busy until 11 ms


def _trace_file(path: Path, rows_: list[list], version: int = 2) -> Path:
    base = {"schema_version": 1, "kind": "run", "name": "full", "unit": "tasks",
            "direction": "none", "status": "ok", "provenance": "measured", "command": "x",
            "params": {"batch": 2, "dtype": "float32"}}
    lines = []
    for step in (0, 1):
        rec = {**base, "metric": "trace.tasks", "value": 1.0,
               "params": {**base["params"], "step": step},
               "method": {"trace_version": version, "columns": list(COLUMNS),
                          "tasks": [[step * 10 + r[0], *r[1:-2], [step * 10 + a for a in r[-2]],
                                     r[-1]] for r in rows_]}}
        lines.append(json.dumps(rec))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_project_on_a_toml_profile_writes_labelled_projected_records(tmp_path: Path) -> None:
    prof = tmp_path / "p.toml"
    prof.write_text('name = "mine"\n[accel]\nmemory_gbps = 100.0\npeak_tflops = 1.0\n'
                    'attention_gbps = 50.0\nlaunch_us = 1.0\n[host]\nattention_gbps = 10.0\n'
                    'launch_us = 2.0\n[h2d]\npageable = 5.0\n[d2h]\npageable = 5.0\n'
                    '[power]\naccel_idle_w = 10.0\naccel_peak_w = 110.0\n')
    src = _trace_file(tmp_path / "run.jsonl",
                      [trace_row(0, "accel", "head", [], flops=3e9, launches=0.0),  # 3 ms
                       trace_row(1, "accel", "bookkeeping", [0], seconds=1e-3)])  # carried 1 ms
    out = tmp_path / "proj.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["project", str(src), "--hardware", str(prof), "--out", str(out)])
    assert e.value.code == 0
    recs = {r["metric"]: r for r in map(json.loads, out.read_text().splitlines())
            if r["kind"] == "run"}
    assert all(r["provenance"] == "projected" and r["params"]["hardware"] == "mine"
               and r["method"]["source_run"] == "x" for r in recs.values())
    assert recs["tbt"]["value"] == pytest.approx(4e-3)
    assert recs["carried_share"]["value"] == pytest.approx(0.25)  # 1 of 4 ms measured
    assert recs["decode_tokens_per_s"]["value"] == pytest.approx(2 / 4e-3)
    # busy the whole step: 110 W * 4 ms over 2 tokens
    assert recs["energy_per_token"]["value"] == pytest.approx(110 * 4e-3 / 2)


def _probe_file(path: Path) -> Path:
    def rec(name: str, metric: str, value: float, **params: object) -> str:
        return json.dumps({"schema_version": 1, "kind": "probe", "name": name,
                           "metric": metric, "value": value, "status": "ok",
                           "params": params, "unit": "", "env_id": "e", "direction": "higher",
                           "provenance": "measured"})
    lines = [rec("roofline", "peak_flops", 0.002, device="cpu", dtype="float32"),
             rec("roofline", "memory_gbps", 8.0, device="cpu"),
             rec("timer", "op_overhead", 4.0, device="cpu"),
             rec("attention", "kv_read_gbps", 2.0, mode="cpu-dense", kv_bytes=1024),
             rec("attention", "kv_read_gbps", 4.0, mode="cpu-dense", kv_bytes=4096)]
    lines += [rec("bandwidth", "bandwidth", g, src="host:0", dst="host:0", memory="pageable",
                  size=s) for s, g in ((1024, 1.0), (1 << 20, 6.0))]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_hardware_this_from_probe_records(tmp_path: Path) -> None:
    probes = _probe_file(tmp_path / "probes.jsonl")
    src = _trace_file(tmp_path / "run.jsonl", [
        trace_row(0, "accel", "pre", [], flops=2e6, bytes_read=8e6, launches=5.0),  # 1 ms + 20 us
        trace_row(1, "h2d", "copy", [0], bytes_moved=2048.0, copies=2.0),  # 2 x 1 KiB at 1 GB/s
        trace_row(2, "host", "attention", [1], bytes_read=4096.0, launches=1.0),  # shares the CPU
        trace_row(3, "pnm", "attention", [], bytes_read=8e5)])  # the PNM role: this CPU, 0.1 ms
    out = tmp_path / "proj.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["project", str(src), "--hardware", "this", "--probes", str(probes),
              "--memory", "pageable", "--out", str(out)])
    assert e.value.code == 0
    recs = {r["metric"]: r for r in map(json.loads, out.read_text().splitlines())
            if r["kind"] == "run"}
    # the PNM task waits for nothing but runs on the one CPU, after the others
    expect = 1e-3 + 20e-6 + 2048 / 1e9 + 4096 / 4e9 + 4e-6 + 8e5 / 8e9
    assert recs["tbt"]["value"] == pytest.approx(expect)
    assert recs["energy_per_token"]["status"] == "waived"


def test_hardware_this_builds_copy_curves_from_the_torch_engine_only() -> None:
    from kvbench.hwmodel.this import build

    def rec(name: str, metric: str, value: float, **params: object) -> dict[str, object]:
        return {"kind": "probe", "name": name, "metric": metric, "value": value,
                "status": "ok", "params": params}
    records = [rec("roofline", "peak_flops", 100.0, device="cuda:0", dtype="bfloat16"),
               rec("roofline", "memory_gbps", 2000.0, device="cuda:0"),
               rec("timer", "op_overhead", 5.0, device="cuda:0"),
               rec("attention", "kv_read_gbps", 1000.0, mode="gpu", kv_bytes=4096)]
    for src, dst in (("host:0", "gpu:0"), ("gpu:0", "host:0")):
        records += [rec("bandwidth", "bandwidth", g, src=src, dst=dst, memory="pageable",
                        engine=engine, size=1 << 20)
                    for engine, g in (("torch", 10.0), ("cupy", 99.0))]
    p = build(records)
    assert p.tables["h2d"]["pageable"]["gbps"] == [10.0]
    assert p.tables["d2h"]["pageable"]["gbps"] == [10.0]


def _v1_file(path: Path) -> Path:
    path.write_text(json.dumps({"schema_version": 1, "kind": "run", "name": "full",
                                "metric": "trace.flops", "value": 1.0, "status": "ok",
                                "params": {"layer": 0}, "unit": "FLOP", "direction": "none",
                                "provenance": "measured"}) + "\n")
    return path


@pytest.mark.parametrize("case, message", [
    ("unknown", "unknown hardware profile 'nope'"),
    ("missing", "has no field 'accel.memory_gbps'"),
    ("no-trace", "no run trace to project (make one with `kvbench run STRATEGY --out FILE`)"),
    ("v1", "an older trace (per-quantity counters, version 1)"),
    ("old-version", "trace version 1; kvbench project reads version 2"),
    ("this-no-calibration", "no calibration of this machine"),
    ("this-no-roofline", "needs peak_flops from the roofline probe"),
])
def test_project_bad_input_exits_2(case: str, message: str, tmp_path: Path, capsys,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    src = _trace_file(tmp_path / "run.jsonl", [trace_row(0, "accel", "head", [], flops=1.0)])
    hw, extra = "a6000-pcie4", []
    if case == "unknown":
        hw = "nope"
    elif case == "missing":
        hw = str(tmp_path / "bad.toml")
        Path(hw).write_text('[accel]\npeak_tflops = 1.0\n')
    elif case == "no-trace":
        src.write_text(json.dumps({"schema_version": 1, "kind": "probe", "name": "timer",
                                   "metric": "x", "value": 1.0, "status": "ok", "unit": "ns",
                                   "direction": "lower", "provenance": "measured"}) + "\n")
    elif case == "v1":
        _v1_file(src)
    elif case == "old-version":
        _trace_file(src, [trace_row(0, "accel", "head", [], flops=1.0)], version=1)
    elif case == "this-no-calibration":  # nor --probes: `kvbench calibrate` (test_calibrate)
        hw = "this"
        monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    elif case == "this-no-roofline":
        hw, extra = "this", ["--probes", str(tmp_path / "p.jsonl")]
        (tmp_path / "p.jsonl").write_text("\n".join(_probe_file(tmp_path / "all.jsonl")
                                                    .read_text().splitlines()[1:]) + "\n")
    assert_usage_error(cli(["project", str(src), "--hardware", hw, "--out",
                            str(tmp_path / "o.jsonl"), *extra], capsys), message)


def test_hardware_list_and_show(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["hardware", "list"])
    assert e.value.code == 0
    assert "a6000-pcie4" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["hardware", "show", "a100-pnm"])
    assert e.value.code == 0
    assert "CXL-PNM Table 2" in capsys.readouterr().out


def _profile_toml(table: str, line: str) -> str:
    """A complete profile with `line` added to `table`."""
    tables = {"accel": ["memory_gbps = 100.0", "peak_tflops = 1.0", "attention_gbps = 50.0",
                        "launch_us = 1.0"],
              "host": ["attention_gbps = 10.0", "launch_us = 2.0"],
              "h2d": ["pageable = 5.0"], "d2h": ["pageable = 5.0"]}
    lines = tables.setdefault(table, [])
    key = line.split("=")[0]
    lines[:] = [x for x in lines if not x.startswith(key)] + [line]
    return "".join(f"[{t}]\n" + "".join(x + "\n" for x in xs) for t, xs in tables.items())


@pytest.mark.parametrize("table, line, message", [
    ("accel", 'memory_gbps = "fast"', "accel.memory_gbps = 'fast': must be a number above 0"),
    ("accel", "memory_gbps = 0", "accel.memory_gbps = 0: must be a number above 0"),
    ("accel", "memory_gbps = -5", "accel.memory_gbps = -5: must be a number above 0"),
    ("accel", "memory_gbps = nan", "accel.memory_gbps = nan: must be a number above 0"),
    ("accel", "launch_us = -1.0", "accel.launch_us = -1.0: must be a number of 0 or more"),
    ("accel", "efficiency = 1.5", "accel.efficiency = 1.5: must be a number in (0, 1]"),
    ("accel", "shares_host = 1", "accel.shares_host = 1: must be true or false"),
    ("accel", 'peak_tflops = { float16 = "x" }', "accel.peak_tflops = {'float16': 'x'}: "
                                                 "TFLOP/s above 0"),
    ("accel", "attention_gbps = -50.0", "accel.attention_gbps = -50.0: a rate must be above 0"),
    ("accel", "memroy_gbps = 100.0", "accel.memroy_gbps: unknown field"),
    ("h2d", "pinned = { peak_gbps = 0, latency_us = 1.0 }",
     "h2d.pinned: peak_gbps must be a number above 0"),
    ("h2d", "pinned = { sizes = [1024, 0], gbps = [1.0, 2.0] }",
     "h2d.pinned: sizes and gbps must be equally long lists of numbers above 0"),
    ("node", "gpus_per_node = 1.5", "node.gpus_per_node = 1.5: must be an integer >= 1"),
    ("gpu", "memory_gbps = 1.0", "unknown table [gpu]"),
])
@pytest.mark.parametrize("command", ["show", "project"])
def test_bad_profile_field_is_refused_by_name(command: str, table: str, line: str,
                                               message: str, tmp_path: Path, capsys) -> None:
    """Every field is checked for type and range on load: 'fast' (ValueError) and 0
    (ZeroDivisionError) used to crash `project`, -5 was accepted, `show` displayed them."""
    prof = tmp_path / "bad.toml"
    prof.write_text(_profile_toml(table, line))
    out = tmp_path / "o.jsonl"
    src = _trace_file(tmp_path / "run.jsonl", [trace_row(0, "accel", "head", [], flops=1.0)])
    argv = (["hardware", "show", str(prof)] if command == "show" else
            ["project", str(src), "--hardware", str(prof), "--out", str(out)])
    assert_usage_error(cli(argv, capsys), f"hardware profile {prof}: {message}")
    assert not out.exists()


def test_the_profile_those_tests_break_loads(tmp_path: Path) -> None:
    prof = tmp_path / "good.toml"
    prof.write_text(_profile_toml("node", "gpus_per_node = 8"))
    assert load(str(prof)).check().get("node", "gpus_per_node") == 8


def test_hardware_show_bad_names(tmp_path: Path, capsys) -> None:
    """An unknown name, a missing, unreadable or corrupt file, and `this` with probe files
    that are missing or not kvbench records: one line, exit 2."""
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "bad.toml").write_text("[accel\nmemory_gbps = 1\n")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    for argv, message in [
        (["nope"], "unknown hardware profile 'nope' (known: a100-80gb-pcie4"),
        (["components/xeon-36c"], "unknown hardware profile"),
        (["q" * 5000], "unknown hardware profile 'qqqq"),
        ([str(tmp_path / ("q" * 300 + ".toml"))], "File name too long"),
        ([str(tmp_path / "dir.toml")], "cannot read hardware profile"),
        ([str(tmp_path / "missing.toml")], "unknown hardware profile"),
        ([str(tmp_path / "bad.toml")], "bad.toml is not valid TOML"),
        (["this", "--probes", str(tmp_path / "missing.jsonl")], "does not exist"),
        (["this", "--probes", str(tmp_path / "bad.jsonl")], "holds no kvbench records"),
    ]:
        line = assert_usage_error(cli(["hardware", "show", *argv], capsys), message)
        assert len(line) < 400, line


def test_scale_to_a_larger_shape_recomputes_dense_and_scales_kv_not_activations() -> None:
    from kvbench.hwmodel.scale import Shape, scale
    from kvbench.models import get_spec
    from kvbench.runtime.trace import dense_work

    src = Shape(get_spec("smollm2-135m"), 1, 100, 1, 4)
    tgt = Shape(get_spec("opt-6.7b"), 2, 199, 1, 2)
    kv_copy = 2.0 * 3 * 64 * 4 * 50  # 50 tokens of K and V of one layer
    q_copy = 9 * 64 * 4.0  # one query
    graph = [_task(0, "accel", "pre", [], step=1, rows=1.0),
             _task(1, "d2h", "copy", [0], step=1, bytes_moved=q_copy, copies=1.0),
             _task(2, "h2d", "copy", [0], step=1, bytes_moved=kv_copy, copies=1.0),
             _task(3, "accel", "post", [1, 2], step=1, rows=1.0)]
    out = scale(graph, src, tgt)
    assert len(out) == 4 * 32  # every target layer replays the source layer
    assert out[0].work == dense_work(tgt.spec, "pre", 2, 2)
    # context 101 -> 200 tokens, batch 2, kv per token 2*32*128*2 B vs 2*3*64*4 B
    c = 200 / 101
    assert out[2].work["bytes_moved"] == pytest.approx(kv_copy * 2 * c * (32 * 128 * 2)
                                                       / (3 * 64 * 4))
    assert out[1].work["bytes_moved"] == pytest.approx(q_copy * 2 * (32 * 128) / (9 * 64))
    assert out[3].after == [1, 2] and out[4].after == [3]  # layer order kept


def test_energy_meter_reads_rapl_with_wraparound_and_waives_without(tmp_path: Path) -> None:
    from kvbench.runtime.energy import Meter

    pkg = tmp_path / "sys/class/powercap/intel-rapl:0"
    pkg.mkdir(parents=True)
    (pkg / "max_energy_range_uj").write_text("1000000\n")
    (pkg / "energy_uj").write_text("900000\n")
    (tmp_path / "sys/class/powercap/intel-rapl:0:0").mkdir()  # a sub-domain: not summed
    m = Meter(tmp_path)
    m.start()
    (pkg / "energy_uj").write_text("100000\n")  # wrapped: 0.1 J to the top, 0.1 J after
    m.stop()
    recs = {r.params["where"]: r for r in m.records("full", {"batch": 1}, 4)}
    assert recs["host"].value == pytest.approx(0.2 / 4)
    assert recs["accel"].status == "waived" and "no GPU" in recs["accel"].reason
    none = Meter(tmp_path / "nowhere")
    none.start()
    none.stop()
    (host,) = [r for r in none.records("full", {}, 1) if r.params["where"] == "host"]
    assert host.status == "waived" and "RAPL not exposed" in host.reason


def test_probes_are_refused_where_no_profile_is_built_from_them(tmp_path: Path,
                                                               capsys) -> None:
    """--probes only builds 'this': given with a named profile it was silently ignored."""
    probes = tmp_path / "p.jsonl"
    probes.write_text("not kvbench\n")
    assert_usage_error(cli(["hardware", "show", "h100-sxm", "--probes", str(probes)], capsys),
                       "--probes: only 'this' is built from probe files; 'h100-sxm' is not")
    assert_usage_error(cli(["project", str(probes), "--hardware", "h100-sxm", "--probes",
                            str(probes), "--out", str(tmp_path / "o.jsonl")], capsys),
                       "--probes: only --hardware this is built from probe files")
    assert not (tmp_path / "o.jsonl").exists()
