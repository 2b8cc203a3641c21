"""`kvbench calibrate` and `kvbench project --hardware this` on its stored calibration."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_usage_error

from kvbench.cli import main
from kvbench.hwmodel.calibrate import (
    KV_CAP,
    MANIFEST,
    RECORDS,
    CalibrateConfig,
    home,
    machine_key,
    plan,
)
from kvbench.models import get_spec
from kvbench.store import load

TINY = ["--quick", "--batch", "1"]  # the shortest calibration: 2 linear rows, 3 KV sizes


def _main(argv: list[str]) -> tuple[int, str]:
    """Exit code and stdout of `kvbench ARGV`."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        main(argv)
    return int(e.value.code or 0), out.getvalue()


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One real quick calibration of this machine: (its cache folder, what it printed)."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVBENCH_CACHE", str(cache))
        code, out = _main(["calibrate", *TINY])
    assert code == 0
    return cache, out


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny `kvbench run` of smollm2-135m (random weights, 1 layer, 2 decode steps)."""
    path = tmp_path_factory.mktemp("run") / "run.jsonl"
    code, _ = _main(["run", "full", "--weights", "random", "--layers", "1", "--prompt-len",
                     "40", "--gen-len", "2", "--threads", "1", "--out", str(path)])
    assert code == 0
    return path


@pytest.fixture
def cache(calibrated: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
          ) -> Path:
    """A copy of the module's calibration as $KVBENCH_CACHE, for a test to spoil."""
    mine = tmp_path / "cache"
    shutil.copytree(calibrated[0], mine)
    monkeypatch.setenv("KVBENCH_CACHE", str(mine))
    return mine


def _this_key() -> str:
    from kvbench.envinfo import collect_env

    return machine_key(collect_env())


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Exit code, stdout and stderr of `kvbench ARGV`."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code, stdout = _main(argv)
    return subprocess.CompletedProcess(argv, code, stdout, err.getvalue())


def _project(trace: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`kvbench project TRACE --hardware this` run."""
    return _run(["project", str(trace), "--hardware", "this", "--out", str(out), *extra])


def test_calibrate_stores_under_the_cache_and_project_uses_it(
        calibrated: tuple[Path, str], cache: Path, trace: Path, tmp_path: Path) -> None:
    folder = cache / "calibration" / _this_key()
    _, printed = calibrated
    # what it printed: where (under $KVBENCH_CACHE), each probe with its shapes, the time
    assert f"{calibrated[0]}/calibration/{_this_key()}/{RECORDS}" in printed
    assert "linear 1536x576 at rows 1,16" in printed  # smollm2-135m's MLP up-projection
    assert "9/3 heads x 64, batch 1, host tokens 64,1024,8192" in printed  # its ctx: 8192
    for probe in ("timer", "roofline", "attention", "bandwidth"):
        assert f"  {probe} v" in printed
    assert "records in" in printed and "(--quick)" in printed
    meta = json.loads((folder / MANIFEST).read_text())
    assert meta["models"] == ["smollm2-135m"] and meta["batch"] == [1] and meta["quick"]
    rs = load(folder / RECORDS)
    assert meta["records"] == len(rs.records) > 0
    assert [machine_key(e) for e in rs.envs.values()] == [_this_key()]
    assert {r["command"].split()[:3][-1] for r in rs.records} == \
        {"timer", "roofline", "attention", "bandwidth"}
    assert all(r["command"].startswith("kvbench probe ") for r in rs.records)
    # project --hardware this reads it, and gives what the same records as --probes give
    proc = _project(trace, tmp_path / "a.jsonl")
    assert proc.returncode == 0, proc.stderr
    proc = _project(trace, tmp_path / "b.jsonl", "--probes", str(folder / RECORDS))
    assert proc.returncode == 0, proc.stderr
    got = [{r["metric"]: r for r in load(tmp_path / f"{n}.jsonl").records} for n in "ab"]
    assert got[0]["tbt"]["provenance"] == "projected"
    assert got[0]["tbt"]["params"]["hardware"] == "this" and got[0]["tbt"]["value"] > 0
    assert got[0]["tbt"]["samples"] == got[1]["tbt"]["samples"]


def test_no_calibration_names_the_command(trace: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "empty"))
    assert_usage_error(_project(trace, tmp_path / "o.jsonl"), "no calibration of this machine",
                       "run `kvbench calibrate --model smollm2-135m`")
    assert not (tmp_path / "o.jsonl").exists()
    monkeypatch.setenv("KVBENCH_CACHE", "off")
    assert_usage_error(_project(trace, tmp_path / "o.jsonl"), "KVBENCH_CACHE=off")
    # refused before it measures anything
    assert_usage_error(_run(["calibrate", "--quick"]), "KVBENCH_CACHE=off")


def test_another_machines_calibration_is_refused(cache: Path, trace: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    mine = _this_key()
    monkeypatch.setattr("socket.gethostname", lambda: "elsewhere")
    other = _this_key()
    assert other != mine  # the host name is part of the key
    assert_usage_error(_project(trace, tmp_path / "o.jsonl"),
                       "no calibration of this machine (host elsewhere",
                       "other machines' only (host ", f"key {mine})")
    # a calibration filed under this machine's key but measured on another one
    (cache / "calibration" / mine).rename(cache / "calibration" / other)
    assert_usage_error(_project(trace, tmp_path / "o.jsonl"), "is of another machine (host",
                       f"key {mine}), not this one (host elsewhere",
                       "run `kvbench calibrate --model smollm2-135m --batch 1 --quick`")


def test_a_probe_of_another_version_is_refused_by_name(cache: Path, trace: Path,
                                                       tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from kvbench.probes import PROBES

    attention = PROBES.get("attention")
    stored = attention.version
    monkeypatch.setattr(attention, "version", stored + "-next")
    assert_usage_error(_project(trace, tmp_path / "o.jsonl"),
                       f"is stale: its attention probe is version {stored}, this kvbench's is "
                       f"{stored}-next",
                       "run `kvbench calibrate --model smollm2-135m --batch 1 --quick`")


def test_a_model_not_calibrated_is_refused(cache: Path, trace: Path, tmp_path: Path) -> None:
    assert_usage_error(_project(trace, tmp_path / "o.jsonl", "--model", "opt-125m"),
                       "is for smollm2-135m, not opt-125m: run `kvbench calibrate --model "
                       "smollm2-135m --model opt-125m --batch 1 --quick`")


def test_a_damaged_calibration_is_refused(cache: Path, trace: Path, tmp_path: Path) -> None:
    (cache / "calibration" / _this_key() / MANIFEST).write_text("{")  # torn write
    assert_usage_error(_project(trace, tmp_path / "o.jsonl"),
                       f"{MANIFEST} unreadable): run `kvbench calibrate --model smollm2-135m`")


def test_home_is_the_env_var_cache_or_the_users(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    assert home() == tmp_path / "calibration"
    monkeypatch.delenv("KVBENCH_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "me"))
    assert home() == tmp_path / "me" / ".cache" / "kvbench" / "calibration"
    monkeypatch.setenv("KVBENCH_CACHE", "off")
    assert home() is None


def _env(**change: Any) -> dict[str, Any]:
    env = {"hostname": "h", "memory_bytes": 16 << 30, "numa_nodes": [{"id": 0}],
           "cpu": {"model": "EPYC", "arch": "x86_64", "logical_cpus": 2, "physical_cores": 1,
                   "caches": [{"level": 3, "size": "32M"}], "affinity_cpus": 2,
                   "governor": "performance"},
           "gpus": [{"name": "H100", "pcie_gen": 5}],
           "versions": {"torch_threads": 2, "kvbench": "1"}, "git_commit": "a"}
    for path, value in change.items():
        *keys, last = path.split("__")
        d = env
        for k in keys:
            d = d[k]
        d[last] = value
    return env


def test_machine_key_ignores_load_threads_and_versions() -> None:
    key = machine_key(_env())
    for same in ({"cpu__affinity_cpus": 1}, {"cpu__governor": "powersave"},
                 {"versions__torch_threads": 1}, {"versions__kvbench": "2"},
                 {"git_commit": "b"}, {"memory_bytes": (16 << 30) - (50 << 20)},
                 {"gpus": [{"name": "H100", "pcie_gen": 1}]}):  # a GPU link idling down
        assert machine_key(_env(**same)) == key, same
    for other in ({"hostname": "g"}, {"cpu__model": "Xeon"}, {"cpu__logical_cpus": 4},
                  {"memory_bytes": 32 << 30}, {"gpus": []}, {"numa_nodes": [{}, {}]}):
        assert machine_key(_env(**other)) != key, other


@pytest.mark.parametrize("model", ["smollm2-135m", "llama-3.1-8b", "opt-125m"])
def test_plan_takes_its_shapes_from_the_model_spec(model: str) -> None:
    spec = get_spec(model)
    steps = {s.probe: s.config for s in plan(CalibrateConfig((model,), (1, 8)), False)}
    roof, att, bw = steps["roofline"], steps["attention"], steps["bandwidth"]
    assert roof.model == model and roof.matmul == min(spec.hidden, 2048)
    assert roof.linear_rows == "1,4,8,16,64,256" and roof.dtype == "float32"
    assert (att.heads, att.kv_heads, att.head_dim) == \
        (str(spec.n_heads), str(spec.n_kv_heads), str(spec.head_dim))
    tokens = [int(t) for t in att.host_tokens.split(",")]
    per_layer = 2 * spec.n_kv_heads * spec.head_dim * 4 * 8  # fp32, batch 8
    assert tokens[0] == 64 and tokens[-1] == min(spec.ctx, KV_CAP // per_layer)
    assert att.modes == "cpu-dense,cpu-sparse" and (bw.src, bw.dst) == ("host:0", "host:0")
    from kvbench.units import parse_sizes

    sizes = parse_sizes(bw.sizes)
    assert sizes[0] <= per_layer // 8 < 2 * sizes[0]  # one token of one layer
    assert sizes[-1] == min(KV_CAP, per_layer * tokens[-1])  # the largest layer of KV
    quick = {s.probe: s.config for s in plan(CalibrateConfig((model,), (1, 8), quick=True),
                                             False)}
    assert quick["roofline"].linear_rows == "1,8,16"
    assert quick["attention"].min_time < att.min_time and quick["bandwidth"].quick


def test_plan_with_cuda_probes_the_gpu_and_its_links() -> None:
    steps = plan(CalibrateConfig(("smollm2-135m",)), True)
    att = next(s.config for s in steps if s.probe == "attention")
    roof = next(s.config for s in steps if s.probe == "roofline")
    assert "gpu" in att.modes.split(",") and att.dtype == "bfloat16"
    assert (roof.dtype, roof.cuda_dtype) == ("float32", "bfloat16")
    assert [(s.config.src, s.config.dst, s.config.memory) for s in steps
            if s.probe == "bandwidth"] == [("host:0", "gpu:0", "both"),
                                           ("gpu:0", "host:0", "both")]


def test_this_reads_the_projected_models_records_among_several() -> None:
    from kvbench.hwmodel.this import build

    def rec(probe: str, metric: str, value: float, **params: object) -> dict[str, Any]:
        return {"kind": "probe", "name": probe, "metric": metric, "value": value,
                "status": "ok", "params": params}

    small, big = get_spec("smollm2-135m"), get_spec("llama-3.1-8b")
    recs = [rec("timer", "op_overhead", 4.0, device="cpu"),
            rec("roofline", "memory_gbps", 8.0, device="cpu"),
            rec("bandwidth", "bandwidth", 5.0, src="host:0", dst="host:0",
                memory="pageable", size=1024)]
    for spec, rate in ((small, 1.0), (big, 2.0)):
        recs += [rec("roofline", "peak_flops", rate, device="cpu", dtype="float32",
                     n=min(spec.hidden, 2048)),
                 rec("roofline", "linear_gbps", rate, device="cpu", rows=1,
                     shape=f"{spec.ffn}x{spec.hidden}"),
                 rec("attention", "kv_read_gbps", rate, mode="cpu-dense", kv_bytes=4096,
                     heads=spec.n_heads, kv_heads=spec.n_kv_heads, head_dim=spec.head_dim)]
    for spec, rate in ((small, 1.0), (big, 2.0)):
        p = build(recs, spec)
        assert p.get("accel", "peak_tflops") == {"float32": rate}
        assert p.get("accel", "dense_gbps")["gbps"] == [rate]
        assert p.get("accel", "attention_gbps")["gbps"] == [rate]
    assert build(recs).get("accel", "dense_gbps")["gbps"] == [1.5]  # no model: all, medians
