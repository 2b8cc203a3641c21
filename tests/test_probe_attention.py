"""attention and roofline probes: tiny runs through the CLI, bad input, plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from conftest import assert_usage_error, cli, cuda_available, drain

from kvbench.cli import main
from kvbench.probes.attention import AttentionProbe
from kvbench.probes.roofline import intensity
from kvbench.store import load
from kvbench.timing import block_medians

TINY = ["probe", "attention", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
        "--gpu-tokens", "64", "--host-tokens", "128", "--query", "1,4", "--dtype", "float32",
        "--min-time", "0"]


def run_cli(args: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 0


def test_attention_tiny_run(tmp_path: Path):
    out = tmp_path / "att.jsonl"
    run_cli([*TINY, "--out", str(out)])
    recs = load(out).records
    by = {(r["metric"], r["params"].get("mode"), r["params"].get("query")): r for r in recs}
    for mode in ("cpu-dense", "cpu-sparse", "hybrid"):
        for q in (1, 4):
            assert by[("time", mode, q)]["status"] == "ok" and by[("time", mode, q)]["value"] > 0
            assert by[("kv_read_gbps", mode, q)]["value"] > 0
    assert by[("time_merge", "hybrid", 1)]["status"] == "ok"
    # every timed quantity (the host copy's too) keeps the passes its samples came from
    for r in recs:
        if r["status"] == "ok" and r["unit"] in ("s", "GB/s"):
            assert len(r["method"]["blocks"]) == 8, r
            assert sum(r["method"]["blocks"]) == len(r["samples"]), r
    bars = {r["metric"] for r in recs if r["metric"].startswith("bar.")}
    assert {"bar.sdpa_time_over_cpu_dense_time", "bar.cpu_sparse_over_dense_gbps",
            "bar.merge_share_of_hybrid"} <= bars
    for r in (r for r in recs if r["metric"] in bars):  # value, bar and pass agree
        op, limit = r["method"]["bar"].split()
        assert r["method"]["pass"] is (r["value"] >= float(limit) if op == ">="
                                       else r["value"] <= float(limit)), r
    # a bar is derived from the run's own records: per pass, merge time over hybrid time
    merge = next(r for r in recs if r["metric"] == "bar.merge_share_of_hybrid"
                 and r["params"]["query"] == 1)

    def passes(rec: dict) -> list[float]:
        return block_medians(rec["samples"], rec["method"]["blocks"])

    shares = [m / h for m, h in zip(passes(by[("time_merge", "hybrid", 1)]),
                                    passes(by[("time", "hybrid", 1)]), strict=True)]
    assert len(shares) == 8 and merge["samples"] == pytest.approx(shares, rel=1e-9)
    assert merge["value"] == pytest.approx(statistics.median(shares), rel=1e-9)
    if not cuda_available():
        assert by[("time", "gpu", 1)]["status"] == "waived"
        assert "no CUDA" in by[("time", "gpu-transfer", 4)]["reason"]
    assert (tmp_path / "att-plots" / "attention-fig11-breakdown.png").stat().st_size > 0


def test_heatmap_from_records(tmp_path: Path):
    shape = {"batch": 1, "heads": 4, "kv_heads": 4, "head_dim": 16, "query": 1,
             "dtype": "float32"}
    recs = [{"name": "attention", "metric": "time", "status": "ok", "value": t,
             "params": {**shape, "gpu_tokens": g, "host_tokens": h, "mode": m}}
            for g in (64, 128) for h in (64, 256)
            for m, t in (("hybrid", 1.0), ("gpu-transfer", 2.0))]
    paths = AttentionProbe.plot(recs, tmp_path)
    assert [p.name for p in paths] == ["attention-fig10-hybrid-speedup.png"]


@pytest.mark.parametrize("args, msg", [
    (["--heads", "6", "--kv-heads", "4"], "multiple of kv heads"),
    (["--keep", "1.5"], "keep fraction"),
    (["--keep", "0"], "keep fraction"),
    (["--dtype", "int8"], "--dtype 'int8': one of float32"),
    (["--modes", "cpu-dense,warp"], "unknown mode"),
    (["--passes", "0"], "--passes must be at least 1"),
])
def test_attention_bad_input(args, msg, capsys, tmp_path):
    assert_usage_error(cli([*TINY, *args, "--out", str(tmp_path / "x.jsonl")], capsys), msg)


@pytest.mark.skipif(cuda_available(), reason="checks the CPU-only refusal")
def test_gpu_mode_forced_without_gpu(capsys, tmp_path):
    assert_usage_error(cli([*TINY, "--modes", "gpu-transfer", "--out",
                            str(tmp_path / "x.jsonl")], capsys), "needs a CUDA GPU")


def test_decode_intensity_is_memory_bound():
    # MHA float32 decode over T tokens: 4*H*D*T FLOPs over 4*D*(2H + 2H*T) bytes -> ~0.5.
    flops, nbytes = intensity(1, 4096, 1, 32, 32, 128, 4)
    assert flops == 4 * 32 * 128 * 4096 and nbytes == 4 * 128 * (64 + 64 * 4096)
    assert 0.49 < flops / nbytes < 0.5
    # Grouped-query attention reads fewer KV bytes for the same FLOPs: higher intensity.
    assert intensity(1, 4096, 1, 32, 8, 128, 4)[1] < nbytes
    prefill = intensity(4096, 4096, 1, 32, 32, 128, 4)
    assert prefill[0] / prefill[1] > 100 * flops / nbytes


def test_roofline_tiny_run(tmp_path: Path):
    out = tmp_path / "roof.jsonl"
    run_cli(["probe", "roofline", "--model", "smollm2-135m", "--tokens", "256", "--matmul",
             "128", "--min-time", "0", "--out", str(out)])
    recs = [json.loads(x) for x in out.read_text().splitlines()[1:]]
    stages = {r["params"]["stage"]: r for r in recs if r["metric"] == "intensity"}
    assert set(stages) == {"prefill", "append", "decode"}
    assert all(r["provenance"] == "projected" for r in stages.values())
    assert stages["decode"]["value"] < stages["append"]["value"] < stages["prefill"]["value"]
    pts = [r for r in recs if r["metric"] == "attention_tflops" and r["params"]["device"] == "cpu"]
    assert len(pts) == 3 and all(r["value"] > 0 for r in pts)
    assert {r["metric"] for r in recs} >= {"peak_flops", "memory_gbps"}
    assert (tmp_path / "roof-plots" / "roofline-fig1.png").stat().st_size > 0


@pytest.mark.parametrize("args, msg", [
    (["--model", "gpt-7"], "unknown model"),
    (["--heads", "6", "--kv-heads", "4", "--head-dim", "8"], "multiple of kv heads"),
    (["--dtype", "int8"], "int8"),
    (["--linear-rows", "x"], "--linear-rows: positive integers"),
    (["--linear-rows", "0,8"], "--linear-rows: positive integers"),
    (["--cuda-dtype", "int8"], "--cuda-dtype 'int8'"),
    (["--cuda-matmul", "0"], "matmul sizes positive"),
])
def test_roofline_bad_input(args, msg, capsys, tmp_path):
    assert_usage_error(cli(["probe", "roofline", *args, "--out", str(tmp_path / "x.jsonl")],
                           capsys), msg)
    assert not (tmp_path / "x.jsonl").exists()  # rejected before anything is written


def test_attention_decode_rounds_read_and_sdpa(tmp_path: Path):
    """Decode: dense, SDPA and a read loop over the KV's bytes timed in the same rounds; the
    read bar is the per-round ratio of dense GB/s over read GB/s; append has neither."""
    out = tmp_path / "dec.jsonl"
    run_cli([*TINY, "--modes", "cpu-dense", "--out", str(out)])
    recs = load(out).records
    by = {(r["metric"], r["params"].get("query")): r for r in recs}
    read, dense = by[("host_read_gbps", 1)], by[("time", 1)]
    kv = by[("kv_read_gbps", 1)]["params"]["kv_bytes"]
    assert read["params"]["bytes"] == kv == 2 * 2 * 128 * 16 * 4 and read["value"] > 0
    frac = by[("bar.cpu_dense_over_host_read", 1)]
    sdpa = by[("bar.sdpa_time_over_cpu_dense_time", 1)]
    assert len(frac["samples"]) == len(sdpa["samples"]) == len(dense["samples"]) >= 3
    for f, t, g in zip(frac["samples"], dense["samples"], read["samples"], strict=True):
        assert f == pytest.approx(kv / t / 1e9 / g, rel=1e-6)
    assert frac["method"]["isa"] in ("avx512", "avx2", "portable")
    assert frac["method"]["bar"] == ">= 0.85"
    assert "per-round" in sdpa["method"]["statistic"] and sdpa["method"]["goal"] == ">= 1.5"
    assert ("host_read_gbps", 4) not in by and ("bar.cpu_dense_over_host_read", 4) not in by


def test_gpu_modes_time_covered_calls_per_event_pair(monkeypatch):
    """Audit finding 7, on the CUDA-shaped fake: a step of 20 launches (7 us of host, 1 us
    of device each) is timed GPU_CALLS calls per event pair behind a wait covering their
    launches, so a sample is the step's 20 us of device time, not its 140 us of launches."""
    from fake_cuda import FakeCuda

    from kvbench.probes.attention import GPU_CALLS
    from kvbench.timing import Policy

    fake = FakeCuda(launch_ns=7_000).install(monkeypatch)

    def step() -> None:
        for _ in range(20):
            fake.launch(1_000)

    probe = AttentionProbe()
    probe.policy = Policy(warmup=1, min_reps=3, min_time_s=0.0)
    t = probe._time(step, "cuda")
    assert GPU_CALLS > 1 and t.seconds == pytest.approx((20e-6,) * 3, rel=1e-12)
    pair = fake.log[len(fake.log) - 1 - fake.log[::-1].index("record", 1):]
    assert pair == ["record", *["kernel"] * (20 * GPU_CALLS), "record"]
    assert t.method()["calls_per_sample"] == GPU_CALLS and t.method()["launch_exposed"] == 0


def test_device_copy_counts_read_plus_write_and_the_decode_bar_divides_by_it():
    """Audit finding 8: a 1 GiB device copy in 1 ms moves 2 GiB (read + written), the
    roofline's memory_gbps convention; GPU decode of 64 MiB of KV in 25 us is read at
    2684.35456 GB/s, 1.25 of the copy's 2147.483648 GB/s."""
    from kvbench.kernels.workload import Point
    from kvbench.probes.attention import DEVICE_COPY_BYTES
    from kvbench.timing import Timing

    assert DEVICE_COPY_BYTES == 1073741824
    probe = AttentionProbe()
    recs, (host_bw, dev_bw) = drain(
        probe._copy_records({"device": [Timing((1e-3,) * 3, "cuda_event", 1)]}, 2))
    (rec,) = recs
    assert rec.metric == "device_copy_gbps" and rec.params["counted"] == "read+write"
    assert rec.value == pytest.approx(2147.483648, rel=1e-12) and dev_bw == rec.value
    # batch 1, 32 KV heads, 4096 tokens, head dim 128, bf16: K and V of 32 MiB each
    p = Point(1, 32, 32, 128, 0, 4096, 1, "bfloat16")
    kv = 2 * 32 * 4096 * 128 * 2
    assert kv == 64 << 20
    res = {"gpu": (Timing((25e-6,), "cuda_event", 1), kv)}
    (bar,) = probe._bars(p, {}, res, host_bw, dev_bw)
    assert bar.metric == "bar.gpu_decode_over_device_copy"
    assert bar.value == pytest.approx(2684.35456 / 2147.483648, rel=1e-12) == 1.25
    assert bar.method["device_copy"] == "bytes read + written" and bar.method["pass"] is True


def test_roofline_measures_each_device_in_its_dtype_and_size():
    """Audit finding 19: the CPU in float32 at 2048, a CUDA GPU in bfloat16 (a run's default
    there) at 8192 unless told otherwise; spellings normalised, bad ones refused."""
    from kvbench.errors import KvbenchError
    from kvbench.probes.roofline import RooflineConfig, device_setup

    cfg = RooflineConfig()
    assert device_setup(cfg, "cpu") == ("float32", 2048)
    assert device_setup(cfg, "cuda:0") == device_setup(cfg, "cuda:1") == ("bfloat16", 8192)
    mine = RooflineConfig(dtype="bfloat16", matmul=512, cuda_dtype="fp16", cuda_matmul=4096)
    assert device_setup(mine, "cpu") == ("bfloat16", 512)
    assert device_setup(mine, "cuda:0") == ("float16", 4096)
    with pytest.raises(KvbenchError, match="--cuda-dtype 'int8'"):
        device_setup(RooflineConfig(cuda_dtype="int8"), "cuda:0")


@pytest.mark.gpu
def test_roofline_cuda_peak_in_bf16_and_float32(tmp_path: Path):
    out = tmp_path / "roof.jsonl"
    run_cli(["probe", "roofline", "--model", "smollm2-135m", "--tokens", "256", "--matmul",
             "128", "--cuda-matmul", "1024", "--min-time", "0", "--out", str(out)])
    recs = load(out).records
    peaks = {(r["params"]["device"], r["params"]["dtype"], r["params"]["n"]) for r in recs
             if r["metric"] == "peak_flops" and r["status"] == "ok"}
    assert {("cpu", "float32", 128), ("cuda:0", "bfloat16", 1024),
            ("cuda:0", "float32", 1024)} <= peaks
    att = {r["params"]["dtype"] for r in recs if r["metric"] == "attention_tflops"
           and r["params"]["device"] == "cuda:0"}
    assert att == {"bfloat16"}


@pytest.mark.gpu
def test_attention_gpu_modes_record_their_cover(tmp_path: Path):
    from kvbench.probes.attention import GPU_CALLS

    out = tmp_path / "att.jsonl"
    run_cli([*TINY, "--modes", "gpu,gpu-transfer", "--passes", "2", "--out", str(out)])
    recs = load(out).records
    gpu = [r for r in recs if r["metric"] == "time" and r["params"].get("mode") == "gpu"]
    assert gpu and all(r["status"] == "ok" for r in gpu)
    for r in gpu:
        assert r["method"]["calls_per_sample"] == GPU_CALLS and "launch_exposed" in r["method"]
    (copy,) = [r for r in recs if r["metric"] == "device_copy_gbps"]
    assert copy["params"]["counted"] == "read+write" and copy["version"] == "3"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["gpu", "gpu-transfer", "cpu-dense", "cpu-sparse", "hybrid"])
def test_kv_read_gbps_is_kv_bytes_over_time(mode: str, dtype: str) -> None:
    """Issue 30: every sample of kv_read_gbps is the KV bytes the mode reads (K and V, every
    batch row and KV head: 2 x B x Hkv x tokens x D x bytes per element, counted here) over
    that sample's step time. Tokens: all (gpu modes), the host's (cpu-dense), the selected
    ones per head on average (cpu-sparse: 40 over 2 x 2 heads = 10), the GPU's plus those
    (hybrid)."""
    from types import SimpleNamespace

    from kvbench.kernels.workload import Point
    from kvbench.timing import Timing

    p = Point(2, 4, 2, 16, 64, 128, 1, dtype)
    w = SimpleNamespace(p=p, total=192, selected=40)
    item = 4 if dtype == "float32" else 2
    tokens = {"gpu": 192, "gpu-transfer": 192, "cpu-dense": 128, "cpu-sparse": 10,
              "hybrid": 64 + 10}[mode]
    kv = 2 * 2 * 2 * tokens * 16 * item
    secs = (1e-3, 2e-3, 4e-3, 3e-3, 5e-3)
    t = Timing(secs, "perf_counter_ns", 1)
    parts = {"total": t, "gpu": t, "cpu": t, "transfer": t, "merge": t}
    if mode == "cpu-dense":
        parts = {"total": t, "sdpa": t, "read": Timing((2e-3,) * 5, "perf_counter_ns", 1)}
    res: dict = {}
    recs = {r.metric: r for r in AttentionProbe()._records(w, mode, {"mode": mode},
                                                           parts, res)}
    rate = recs["kv_read_gbps"]
    assert rate.params["kv_bytes"] == kv
    assert rate.samples == [kv / s / 1e9 for s in secs]
    assert rate.value == kv / 3e-3 / 1e9  # the median time's rate
    assert recs["time"].samples == list(secs) and res[mode] == (t, kv)
    if mode == "cpu-dense":  # the read loop reads the KV's bytes (under COPY_BYTES)
        assert recs["host_read_gbps"].samples == [kv / 2e-3 / 1e9] * 5
        assert res["read"] == [(kv / s / 1e9) / (kv / 2e-3 / 1e9) for s in secs]


def test_host_copy_gbps_counts_the_bytes_once():
    """Issue 30: a host copy of COPY_BYTES (256 MiB = 268435456 bytes) in s seconds is
    0.268435456 / s GB/s per sample (memcpy's convention: bytes once); the bar's host rate
    is the best of the copies' medians."""
    from kvbench.probes.attention import COPY_BYTES
    from kvbench.timing import Timing

    assert COPY_BYTES == 268435456
    recs, (host_bw, dev_bw) = drain(AttentionProbe()._copy_records({
        "native": [Timing((0.1, 0.05), "CLOCK_MONOTONIC (native)", 1),
                   Timing((0.2,), "CLOCK_MONOTONIC (native)", 1)],
        "torch copy_": [Timing((0.4, 0.5, 0.6), "perf_counter_ns", 1)]}, 2))
    native, torch_copy = recs
    assert native.samples == pytest.approx([2.68435456, 5.36870912, 1.34217728], rel=1e-12)
    assert native.value == pytest.approx(2.68435456, rel=1e-12)
    assert native.method["blocks"] == [2, 1] and native.params["bytes"] == COPY_BYTES
    assert torch_copy.value == pytest.approx(0.268435456 / 0.5, rel=1e-12)
    assert host_bw == native.value and dev_bw is None
