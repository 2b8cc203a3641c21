"""`kvbench probe roofline`'s arithmetic exactly (issue 30): attention intensity by hand, the
shapes and dtypes each device runs, and every record of a CPU run whose timings are replaced
by known ones, so each rate is checked against its formula written here."""

from __future__ import annotations

import math

import pytest

from kvbench.errors import KvbenchError
from kvbench.models import get_spec
from kvbench.probes import roofline
from kvbench.probes.roofline import RooflineConfig, RooflineProbe, device_setup, intensity, shapes
from kvbench.timing import PASSES, Policy, Timing

SECONDS = (0.5, 0.25)


@pytest.mark.parametrize("lq, flops, nbytes", [
    (1, 4 * 2 * 4 * 8 * 100, 2 * 2 * 8 * (2 * 4 * 1 + 2 * 2 * 100)),  # decode: 100 keys
    (32, 4 * 2 * 4 * 8 * (3200 - 496), 2 * 2 * 8 * (2 * 4 * 32 + 2 * 2 * 100)),  # append
    (100, 4 * 2 * 4 * 8 * (10000 - 4950), 2 * 2 * 8 * (2 * 4 * 100 + 2 * 2 * 100)),
])
def test_intensity_counts_visible_pairs_and_qkvo_bytes(lq: int, flops: int,
                                                       nbytes: int) -> None:
    """Batch 2, 4 query heads over 2 KV heads, D 8, 100 tokens, 2-byte elements: query i of
    lq sees 100 - lq + i + 1 keys; Q and O of every query, K and V of every token, once."""
    assert intensity(lq, 100, 2, 4, 2, 8, 2) == (flops, nbytes)


def test_shapes_and_device_setup() -> None:
    spec = get_spec("smollm2-135m")
    assert shapes(RooflineConfig(model="smollm2-135m")) == (
        "smollm2-135m", spec.n_heads, spec.n_kv_heads, spec.head_dim)
    assert shapes(RooflineConfig(heads=8, head_dim=16)) == ("custom", 8, 8, 16)
    assert shapes(RooflineConfig(heads=8, kv_heads=2, head_dim=16)) == ("custom", 8, 2, 16)
    with pytest.raises(KvbenchError, match=r"^--heads needs --head-dim$"):
        shapes(RooflineConfig(heads=8))
    with pytest.raises(KvbenchError, match=r"^heads \(8\) must be a multiple of kv heads "
                                           r"\(3\)$"):
        shapes(RooflineConfig(heads=8, kv_heads=3, head_dim=16))
    config = RooflineConfig(dtype="bf16", matmul=64, cuda_dtype="fp16", cuda_matmul=128)
    assert device_setup(config, "cpu") == ("bfloat16", 64)
    assert device_setup(config, "cuda:1") == ("float16", 128)


def test_every_record_of_a_cpu_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every quantity timed as SECONDS (the function itself never runs): each record's
    samples are its formula over those seconds, in its unit, with its parameters."""
    policies: list[Policy] = []
    monkeypatch.setattr(roofline, "LINEAR_BYTES", 8 << 20)  # 3 copies of the MLP weight
    monkeypatch.setattr(roofline, "time_host", lambda fn, policy: policies.append(policy)
                        or Timing(SECONDS, "fake", policy.warmup))
    config = RooflineConfig(model="smollm2-135m", tokens=64, batch=2, matmul=64,
                            linear_rows="1,2", min_time=0.01)
    recs = list(RooflineProbe().run(config))
    spec = get_spec("smollm2-135m")
    base = {"model": "smollm2-135m", "heads": spec.n_heads, "kv_heads": spec.n_kv_heads,
            "head_dim": spec.head_dim, "tokens": 64, "batch": 2}
    stages = {"prefill": 64, "append": 32, "decode": 1}
    work = {s: intensity(q, 64, 2, spec.n_heads, spec.n_kv_heads, spec.head_dim, 4)
            for s, q in stages.items()}
    by = {(r.metric, r.params.get("stage"), r.params.get("rows")): r for r in recs}
    assert len(by) == len(recs) == 3 + 1 + 1 + 2 + 3

    for s, (f, b) in work.items():
        r = by["intensity", s, None]
        assert (r.name, r.unit, r.direction, r.provenance, r.samples) == (
            "roofline", "FLOP/B", "none", "projected", [f / b])
        assert r.method == {"formula": "4*B*H*D*visible pairs / (Q+O+K+V bytes)"}
        assert r.params == {**base, "dtype": "float32", "stage": s}
        r = by["attention_tflops", s, None]
        assert r.samples == pytest.approx([f / x / 1e12 for x in SECONDS] * PASSES)
        assert r.params == {**base, "dtype": "float32", "stage": s, "device": "cpu",
                            "intensity": round(f / b, 4)}
    r = by["peak_flops", None, None]
    assert r.samples == pytest.approx([2 * 64**3 / x / 1e12 for x in SECONDS] * PASSES)
    assert (r.unit, r.params) == ("TFLOP/s", {"device": "cpu", "dtype": "float32", "n": 64})
    size = 256 << 20
    r = by["memory_gbps", None, None]
    assert r.samples == pytest.approx([2 * size / x / 1e9 for x in SECONDS] * PASSES)
    assert (r.unit, r.params) == ("GB/s", {"device": "cpu", "bytes": size,
                                           "how": "torch copy_, read+write"})
    one = spec.hidden * spec.ffn * 4
    weights = math.ceil((8 << 20) / one) * one  # copies cycled per call
    assert weights == 3 * one
    for rows in (1, 2):
        r = by["linear_gbps", None, rows]
        assert r.samples == pytest.approx([weights / x / 1e9 for x in SECONDS] * PASSES)
        assert r.params == {"device": "cpu", "dtype": "float32", "rows": rows,
                            "shape": f"{spec.ffn}x{spec.hidden}", "weight_bytes": weights}
    assert all(r.direction == "higher" and r.method["timer"] == "fake" for r in recs
               if r.metric != "intensity")
    # each measured quantity once per pass, under the probe's policy
    policy = Policy(warmup=1, min_reps=3, min_time_s=0.01, max_reps=50,
                    max_time_s=3.0).share(PASSES)
    assert len(policies) == PASSES * (1 + 1 + 2 + 3)
    assert {(p.min_reps, p.max_reps, p.min_time_s, p.max_time_s) for p in policies} == {
        (policy.min_reps, policy.max_reps, policy.min_time_s, policy.max_time_s)}
    assert sorted({p.warmup for p in policies}) == [0, 1]  # one warm-up, in the first pass


@pytest.mark.parametrize("field, value, ok", [
    ("tokens", 32, True), ("tokens", 31, False), ("batch", 1, True), ("batch", 0, False),
    ("matmul", 1, True), ("matmul", 0, False), ("cuda_matmul", 1, True),
    ("cuda_matmul", 0, False)])
def test_run_bounds(field: str, value: int, ok: bool, monkeypatch) -> None:
    """At least 32 tokens, batch and matmul sizes of 1 or more: the edge passes its check
    (the run stops in _points, stubbed), one below is refused with the one message."""
    monkeypatch.setattr(RooflineProbe, "_points", lambda *a: [])
    config = RooflineConfig(model="smollm2-135m", **{field: value})
    if ok:
        assert [r.metric for r in RooflineProbe().run(config)] == ["intensity"] * 3
    else:
        with pytest.raises(KvbenchError, match=r"^tokens must be >= 32, batch and matmul "
                                               r"sizes positive$"):
            list(RooflineProbe().run(config))
