"""`kvbench probe attention`'s records exactly on the CPU (issue 30): every timer replaced by
one giving known seconds per call, so each record's samples are checked against the formula
written here (KV bytes of each mode over its time, copies, the read loop, the bars' ratios),
with its parameters and its bar verdict; the GPU modes waived."""

from __future__ import annotations

import pytest

from kvbench.kernels.workload import Point, Workload
from kvbench.probes import attention
from kvbench.probes.attention import COPY_BYTES, AttentionConfig, AttentionProbe
from kvbench.timing import Timing

HOST = (0.5, 0.25)  # seconds per call of every host-timed quantity
NATIVE = (0.125,)  # the native memcpy's
DENSE, SDPA, READ = (0.2, 0.4), (0.3, 0.6), (0.1, 0.1)  # the dense decode rounds
PASSES = 2


@pytest.fixture
def fake_timers(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    calls: list[tuple] = []

    def host(fn, policy):
        calls.append(("host", policy))
        return Timing(HOST, "fake host", policy.warmup)

    def native(fn, policy):
        calls.append(("native", policy))
        return Timing(NATIVE, "fake native", policy.warmup)

    def rounds(fns, policy, timer):
        calls.append(("rounds", policy, len(fns), timer))
        return [Timing(s, "fake rounds", 0) for s in (DENSE, SDPA, READ)]

    monkeypatch.setattr(attention, "time_host", host)
    monkeypatch.setattr(attention, "time_native", native)
    monkeypatch.setattr(attention, "time_rounds", rounds)
    return calls


def _gbps(nbytes: float, seconds: tuple[float, ...]) -> list[float]:
    return [nbytes / s / 1e9 for s in seconds] * PASSES


def test_every_record_of_a_cpu_grid(fake_timers: list[tuple]) -> None:
    config = AttentionConfig(batch="2", heads="4", kv_heads="2", head_dim="8",
                             gpu_tokens="16", host_tokens="64", query="1,4", dtype="float32",
                             keep=0.25, threads=1, min_time=0.01, passes=PASSES)
    recs = list(AttentionProbe().run(config))
    by: dict[tuple, object] = {}
    for r in recs:
        key = (r.metric, r.params.get("query"), r.params.get("mode"), r.params.get("how"))
        assert key not in by, key
        by[key] = r
    for q in (1, 4):
        p = Point(2, 4, 2, 8, 16, 64, q, "float32")
        w = Workload(p, 0.25, 1, False)  # the same seed: the same selection
        base = {**p.params(), "keep": 0.25, "threads": 1, "device": "cpu"}
        for mode in ("gpu", "gpu-transfer"):
            r = by["time", q, mode, None]
            assert (r.status, r.reason, r.params) == ("waived", "no CUDA GPU on this machine",
                                                      {**base, "mode": mode})
        host_kv = 2 * 2 * 2 * 64 * 8 * 4
        sparse = w.selected / (2 * 2)  # selected tokens per (sequence, KV head)
        kv = {"cpu-dense": host_kv, "cpu-sparse": p.kv_bytes(sparse),
              "hybrid": p.kv_bytes(16 + sparse)}
        dense_s = DENSE if q == 1 else HOST
        for mode, nbytes in kv.items():
            total = dense_s if mode == "cpu-dense" else HOST
            r = by["kv_read_gbps", q, mode, None]
            assert r.samples == pytest.approx(_gbps(nbytes, total))
            assert (r.unit, r.direction) == ("GB/s", "higher")
            assert r.params == {**base, "mode": mode, "kv_bytes": int(nbytes)}
            t = by["time", q, mode, None]
            assert (t.unit, t.direction, t.samples) == ("s", "lower", list(total) * PASSES)
        parts = {"cpu-dense": ["cpu"], "cpu-sparse": ["cpu"],
                 "hybrid": ["gpu", "cpu", "merge"]}
        for mode, names in parts.items():
            got = sorted(k[0] for k in by if k[1] == q and k[2] == mode
                         and k[0].startswith("time_"))
            assert got == sorted(f"time_{n}" for n in names), (q, mode)
        assert by["time_cpu", q, "cpu-dense", None].samples == list(dense_s) * PASSES
        if q == 1:  # the read loop beside dense decode, and its per-round bars
            r = by["host_read_gbps", 1, "cpu-dense", "native read loop"]
            assert r.samples == pytest.approx(_gbps(host_kv, READ))
            assert r.params["bytes"] == host_kv == AttentionProbe._read_bytes(w)
            r = by["bar.sdpa_time_over_cpu_dense_time", 1, None, None]
            ratios = [s / d for s, d in zip(SDPA, DENSE, strict=True)]
            assert r.samples == pytest.approx(ratios * PASSES)
            assert r.method["bar"] == ">= 1.0" and r.method["pass"] is True
            assert r.method["goal"] == ">= 1.5" and r.method["blocks"] == [2, 2]
            r = by["bar.cpu_dense_over_host_read", 1, None, None]
            assert r.samples == pytest.approx([(host_kv / d) / (host_kv / x)
                                               for x, d in zip(READ, DENSE, strict=True)] * PASSES)
            assert r.method["bar"] == ">= 0.85" and r.method["pass"] is False
        else:
            assert ("bar.sdpa_time_over_cpu_dense_time", 4, None, None) not in by
        r = by["bar.cpu_sparse_over_dense_gbps", q, None, None]
        d_med = sorted(dense_s)[len(dense_s) // 2] if len(dense_s) % 2 else sum(dense_s) / 2
        h_med = sum(HOST) / 2
        assert r.samples == pytest.approx([(kv["cpu-sparse"] / h_med)
                                           / (host_kv / d_med)] * PASSES)
        assert (r.direction, r.method["bar"]) == ("higher", ">= 0.5")
        r = by["bar.merge_share_of_hybrid", q, None, None]
        assert r.samples == pytest.approx([1.0] * PASSES)  # merge and hybrid: both HOST
        assert (r.direction, r.method["bar"], r.method["pass"]) == ("lower", "<= 0.05", False)
        assert ("bar.cpu_dense_over_host_copy", q, None, None) not in by  # KV under 64 MiB
    for how, seconds in (("native memcpy threads", NATIVE), ("torch copy_", HOST)):
        r = by["host_copy_gbps", None, None, how]
        assert r.samples == pytest.approx(_gbps(COPY_BYTES, seconds))
        assert r.params == {"how": how, "bytes": COPY_BYTES, "threads": 1}
    r = by["device_copy_gbps", None, None, None]
    assert (r.status, r.reason) == ("waived", "no CUDA GPU on this machine")
    # every quantity under the probe's policy, its share of each pass
    policy = attention.Policy(warmup=1, min_reps=max(3, 2 * PASSES), min_time_s=0.01,
                              max_reps=50, max_time_s=3.0).share(PASSES)
    assert {c[1] for c in fake_timers} == {policy}
    assert [c[2:] for c in fake_timers if c[0] == "rounds"] == [
        (3, "perf_counter_ns (attention), CLOCK_MONOTONIC (read loop)")] * PASSES
