"""Eval mode: the full-attention reference stays out of the strategy's timings (issue 11.4)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import needs_bundled

from kvbench.cli import main
from kvbench.models import get_spec
from kvbench.runtime.context import Counters, RunContext
from kvbench.runtime.shadow import Shadow
from kvbench.store import load
from kvbench.strategies import NoParams
from kvbench.strategies.full import Full


def test_reference_runs_between_steps() -> None:
    """A decode call only runs the strategy; the reference attention and the error of each
    output run at the next begin_step, and the error is filed at the step it belongs to."""
    spec = get_spec("smollm2-135m")
    cpu = torch.device("cpu")
    counters = Counters(spec.n_kv_heads, 4)
    ctx = RunContext(spec, 2, 1, 16, torch.float32, cpu, cpu, counters, None)
    shadow = Shadow(Full(NoParams(), ctx), ctx)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 4, spec.head_dim, generator=g)
               for h in (spec.n_heads, spec.n_kv_heads, spec.n_kv_heads))
    shadow.begin_step(0)
    for layer in (0, 1):
        counters.layer = layer
        shadow.prefill(layer, q, k, v)
    assert shadow.ref.length == [0, 0]  # nothing of the reference ran yet
    q.zero_()  # a caller reusing its buffer does not change what the reference sees
    counters.step = 1
    shadow.begin_step(1)
    assert shadow.ref.length == [4, 4]
    errors = {(layer, s): v for qn, _, layer, steps in counters.series() if qn == "rel_error"
              for s, v in steps.items()}
    assert errors.keys() == {(0, 0), (1, 0)}  # filed at the prefill, both layers
    assert all(e < 1e-6 for e in errors.values())  # full against full: exact


@needs_bundled
def test_eval_run_times_exclude_reference(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """In a real eval run every reference call comes from Shadow.flush (between steps,
    outside the clock); times say so and peak memory, holding its cache, is waived."""
    callers: list[str] = []
    prefill = Full.prefill

    def spy(self: Full, *a: Any) -> torch.Tensor:
        callers.append(inspect.stack()[1].function)
        return prefill(self, *a)

    monkeypatch.setattr(Full, "prefill", spy)
    monkeypatch.setattr(Full, "decode", spy)
    out = tmp_path / "r.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["run", "h2o", "--mode", "eval", "--layers", "2", "--prompt-len", "32",
              "--gen-len", "3", "--threads", "1", "--out", str(out)])
    assert e.value.code == 0
    assert callers and set(callers) == {"flush"}
    recs = {(r["metric"], r["params"].get("where")): r for r in load(out).records}
    for metric in ("ttft", "tbt", "decode_tokens_per_s"):
        assert "outside the timed region" in recs[(metric, None)]["method"]["shadow"]
    assert recs[("peak_memory", "host")]["status"] == "waived"
    assert len(recs[("attention_rel_error", None)]["samples"]) == 2  # one per layer


def test_report_labels_eval_mode_times() -> None:
    """A report never shows an eval-mode time as a plain generate-mode one."""
    from kvbench.report import label

    def rec(metric: str, unit: str, mode: str) -> dict[str, Any]:
        return {"kind": "run", "metric": metric, "unit": unit, "provenance": "measured",
                "params": {"mode": mode}}

    assert label(rec("tbt", "s", "eval")) == "tbt (eval mode)"
    assert label(rec("decode_tokens_per_s", "tokens/s", "eval")).endswith("(eval mode)")
    assert label(rec("tbt", "s", "generate")) == "tbt"
    assert label(rec("perplexity", "ppl", "eval")) == "perplexity"


SPARSE = {  # budgets below the 73-token context, so the selections change every step
    "arkvale": {"budget_tokens": 32, "page_size": 8, "dense_layers": 1, "sinks": 1,
                "window_pages": 1},
    "h2o": {"gpu_share": 0.3},
    "hgca": {"gpu_share": 0.3},
    "infinigen": {"variant": "oracle", "budget_tokens": 24, "dense_layers": 1,
                  "skew_tokens": 16},
    "png-kv": {"budget_tokens": 32, "page_size": 8, "dense_layers": 1, "sinks": 1,
               "window_pages": 1},
    "pnm-kv": {"budget_tokens": 32, "page_size": 8, "dense_layers": 1, "sinks": 1,
               "window_pages": 1},
    "quest": {"budget_tokens": 32, "page_size": 8, "dense_layers": 1},
    "scout": {"budget_tokens": 32, "page_size": 8, "dense_layers": 1, "recall_interval": 2},
    "streaming": {"gpu_share": 0.3},
}


def test_every_strategy_with_a_mask_is_covered() -> None:
    from kvbench.strategies import STRATEGIES, Strategy

    assert set(SPARSE) == {n for n in STRATEGIES.names()
                           if STRATEGIES.get(n).attended is not Strategy.attended}


@pytest.mark.parametrize("name", sorted(SPARSE))
def test_attended_masks_are_read_at_flush(name: str) -> None:
    """GPU audit finding 12: a decode's attended mask is read in flush, outside the timed
    step (hgca's joins its worker and copies the mask, scout's syncs), and equals the mask
    read right after that decode: nothing between the step and the next begin_step (nor,
    where the strategy appends, the next turn's) changes which positions a layer attended.
    Every (step, layer) gets its topk_recall."""
    import dataclasses

    from kvbench.models import ModelSpec
    from kvbench.models.weights import load as load_model
    from kvbench.runtime.run import decode_run
    from kvbench.strategies import STRATEGIES, supports_append

    spec = ModelSpec("tiny-gqa", "llama", 2, 6, 2, 48, 96, 100, 512, head_dim=8)
    cpu = torch.device("cpu")
    model = load_model(spec, "random", 2, torch.float32, cpu, seed=1).model
    cls = STRATEGIES.get(name)
    turns = 2 if supports_append(cls) else 1
    counters = Counters(spec.n_kv_heads, 4)
    ctx = RunContext(spec, 2, 1, 73 * turns, torch.float32, cpu, cpu, counters, model)
    inner = cls(dataclasses.replace(cls.params(), **SPARSE[name]), ctx)
    attended, decode = inner.attended, inner.decode
    eager: list[torch.Tensor] = []  # read right after each decode (not by the shadow)
    late: list[tuple[str, torch.Tensor]] = []  # what the shadow read, and where

    def decode_spy(layer: int, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
        out = decode(layer, q, k, v)
        eager.append(attended(layer).clone())
        return out

    def attended_spy(layer: int) -> torch.Tensor:
        mask = attended(layer)
        late.append((inspect.stack()[1].function, mask.clone()))
        return mask

    inner.decode, inner.attended = decode_spy, attended_spy
    shadow = Shadow(inner, ctx)
    model.setup(shadow, counters, 73 * turns)
    rows = torch.randint(0, 100, (1, 73 * turns), generator=torch.Generator().manual_seed(0))
    decode_run(model, shadow, rows, 8, "eval", lambda: None, turns=turns)
    shadow.flush()
    assert {caller for caller, _ in late} == {"flush"}
    assert len(late) == len(eager) == 8 * turns * 2
    for (_, mask), ref in zip(late, eager, strict=True):
        assert mask.device == ctx.accel and torch.equal(mask, ref)
    assert any(not bool(m.all()) for m in eager)  # some step really was sparse
    recall = {(layer, s) for qn, _, layer, steps in counters.series()
              if qn == "topk_recall" for s in steps}
    assert recall == {(layer, s) for layer in (0, 1) for s in range(1, 8 * turns + 1)}


def test_error_of_a_sparse_strategy_is_its_distance_from_full_attention() -> None:
    """Issue 30: StreamingLLM keeping 1 sink + 3 recent of 17 tokens. The decode's error
    filed by the shadow is ||out - ref|| / ||ref|| with ref full attention computed here in
    float64 (softmax(q k^T / sqrt(D)) v over every cached position, KV heads shared by
    Hq / Hkv query heads), and far from 0."""
    import dataclasses

    from kvbench.strategies.streaming import Streaming

    spec = get_spec("smollm2-135m")
    cpu = torch.device("cpu")
    counters = Counters(spec.n_kv_heads, 4)
    ctx = RunContext(spec, 1, 1, 32, torch.float32, cpu, cpu, counters, None)
    inner = Streaming(dataclasses.replace(Streaming.params(), gpu_tokens=4, sinks=1), ctx)
    shadow = Shadow(inner, ctx)
    g = torch.Generator().manual_seed(3)
    hq, hkv, d = spec.n_heads, spec.n_kv_heads, spec.head_dim

    def qkv(t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.randn(1, hq, t, d, generator=g), torch.randn(1, hkv, t, d, generator=g),
                torch.randn(1, hkv, t, d, generator=g))

    q0, k0, v0 = qkv(16)
    counters.layer, counters.step = 0, 0
    shadow.begin_step(0)
    shadow.prefill(0, q0, k0, v0)
    q1, k1, v1 = qkv(1)
    counters.step = 1
    shadow.begin_step(1)
    out = shadow.decode(0, q1, k1, v1).clone()
    shadow.flush()
    k = torch.cat([k0, k1], 2).double().repeat_interleave(hq // hkv, dim=1)
    v = torch.cat([v0, v1], 2).double().repeat_interleave(hq // hkv, dim=1)
    ref = torch.softmax(q1.double() @ k.transpose(-1, -2) / d ** 0.5, dim=-1) @ v
    expected = float((out.double() - ref).norm() / ref.norm())
    errors = {s: e for qn, _, layer, steps in counters.series() if qn == "rel_error"
              for s, e in steps.items()}
    assert errors[0] < 1e-5  # the prefill attends densely
    assert expected > 1e-2 and errors[1] == pytest.approx(expected, rel=1e-4)
