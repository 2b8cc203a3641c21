"""The eval-mode shadow's arithmetic on tiny shapes (kvbench.runtime.shadow): the relative
error and the top-10 recall computed by hand in float64, filed at the step and layer they
belong to; every call forwarded to the strategy (issue 30: the mutation run's shadow)."""

from __future__ import annotations

import pytest
import torch

from kvbench.models import get_spec
from kvbench.runtime.context import Counters, RunContext
from kvbench.runtime.shadow import Shadow
from kvbench.strategies import NoParams
from kvbench.strategies.full import Full

SPEC = get_spec("smollm2-135m")
HQ, HKV, D = SPEC.n_heads, SPEC.n_kv_heads, SPEC.head_dim


class Scaled(Full):
    """Full attention whose outputs are scaled by `factor` (its error is |factor - 1|),
    that attends the positions `mask` says, and logs what reaches it."""

    factor = 2.0
    mask: torch.Tensor | None = None

    def __init__(self, params: object, ctx: RunContext) -> None:
        super().__init__(params, ctx)
        self.log: list[tuple] = []

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        return super().prefill(layer, q, k, v) * self.factor

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        return super().decode(layer, q, k, v) * self.factor

    def append(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        self.log.append(("append", layer, q.shape[2]))
        return super().append(layer, q, k, v) * self.factor

    def begin_step(self, step: int) -> None:
        self.log.append(("begin", step))

    def layer_input(self, layer: int, x: torch.Tensor) -> None:
        self.log.append(("input", layer, tuple(x.shape)))

    def attended(self, layer: int) -> torch.Tensor | None:
        self.log.append(("attended", layer))
        return self.mask


def _ctx(layers: int = 2) -> RunContext:
    cpu = torch.device("cpu")
    return RunContext(SPEC, layers, 1, 32, torch.float32, cpu, cpu, Counters(HKV, 4), None)


def _qkv(g: torch.Generator, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(1, HQ, t, D, generator=g), torch.randn(1, HKV, t, D, generator=g),
            torch.randn(1, HKV, t, D, generator=g))


def _filed(c: Counters, quantity: str) -> dict[tuple[int, int], float]:
    return {(layer, s): v for qn, _, layer, steps in c.series() if qn == quantity
            for s, v in steps.items()}


@pytest.mark.parametrize("factor", [2.0, 0.0, 1.25])
def test_error_is_the_relative_distance_filed_at_its_step_and_layer(factor: float) -> None:
    """An output scaled by f is f ref: ||f ref - ref|| / ||ref|| = |f - 1| exactly, for the
    prefill, the decode and an append alike; the counters' step and layer are restored."""
    ctx = _ctx()
    c = ctx.counters
    inner = Scaled(NoParams(), ctx)
    inner.factor = factor
    shadow = Shadow(inner, ctx)
    g = torch.Generator().manual_seed(0)
    shadow.begin_step(0)
    for layer in (0, 1):
        c.layer = layer
        shadow.prefill(layer, *_qkv(g, 5))
    c.step = 1
    shadow.begin_step(1)
    c.layer = 1
    shadow.decode(1, *_qkv(g, 1))
    c.step = 2
    shadow.begin_step(2)
    shadow.append(1, *_qkv(g, 3))
    c.step, c.layer = 7, 0
    shadow.flush()
    assert (c.step, c.layer) == (7, 0)
    errors = _filed(c, "rel_error")
    assert errors.keys() == {(0, 0), (1, 0), (1, 1), (1, 2)}
    assert all(e == pytest.approx(abs(factor - 1), rel=1e-5, abs=1e-6)
               for e in errors.values()), errors
    assert _filed(c, "topk_recall") == {}  # the mask was None: no recall
    assert inner.log == [("begin", 0), ("begin", 1), ("attended", 1), ("begin", 2),
                         ("append", 1, 3)]
    assert shadow.ref.length == [5, 9]  # the reference saw every call
    assert not shadow._pending


def test_zero_reference_has_no_nan_error() -> None:
    ctx = _ctx(1)
    shadow = Shadow(Scaled(NoParams(), ctx), ctx)
    q, k, v = (torch.zeros(1, h, 2, D) for h in (HQ, HKV, HKV))
    shadow.prefill(0, q, k, v)
    shadow.flush()
    assert _filed(ctx.counters, "rel_error") == {(0, 0): 0.0}


def test_recall_is_the_share_of_full_attentions_top_ten_keys_attended() -> None:
    """12 cached keys + the decode's own: the strategy attends positions 0..5 of every
    head; recall = |top-10 of q.k over the 13 keys (per query head) within 0..5| / 10, the
    mean over heads, by hand in float64."""
    ctx = _ctx(1)
    c = ctx.counters
    inner = Scaled(NoParams(), ctx)
    shadow = Shadow(inner, ctx)
    g = torch.Generator().manual_seed(5)
    q0, k0, v0 = _qkv(g, 12)
    shadow.prefill(0, q0, k0, v0)
    c.step = 1
    shadow.begin_step(1)
    q1, k1, v1 = _qkv(g, 1)
    shadow.decode(0, q1, k1, v1)
    inner.mask = torch.zeros(1, HQ, 13, dtype=torch.bool)
    inner.mask[:, :, :6] = True
    shadow.flush()
    keys = torch.cat([k0, k1], 2).double().repeat_interleave(HQ // HKV, dim=1)[0]
    hits = []
    for h in range(HQ):
        logits = keys[h] @ q1[0, h, 0].double()
        top = sorted(range(13), key=lambda i: -float(logits[i]))[:10]
        hits.append(sum(i < 6 for i in top) / 10)
    expected = sum(hits) / HQ
    recall = _filed(c, "topk_recall")
    assert recall.keys() == {(0, 1)}
    assert recall[(0, 1)] == pytest.approx(expected, rel=1e-6)  # a float32 mean
    assert 0 < expected < 1


def test_recall_over_fewer_keys_than_ten_and_calls_forwarded() -> None:
    ctx = _ctx(1)
    inner = Scaled(NoParams(), ctx)
    shadow = Shadow(inner, ctx)
    g = torch.Generator().manual_seed(6)
    shadow.prefill(0, *_qkv(g, 3))
    shadow.layer_input(0, torch.zeros(1, 2, 8))
    shadow.decode(0, *_qkv(g, 1))
    inner.mask = torch.tensor([[[True, False, True, True]] * HQ])
    shadow.flush()  # every key is in the top 10 of 4: 3 of 4 attended
    assert _filed(ctx.counters, "topk_recall") == {(0, 0): pytest.approx(0.75)}
    assert ("input", 0, (1, 2, 8)) in inner.log


def test_the_shadow_files_under_attention_with_its_own_reference_counters() -> None:
    """Outputs of norm well below 1 (v scaled by 1e-4): the error is still |f - 1|; the
    reference counts into counters of its own, shaped like the run's."""
    ctx = _ctx(1)
    c = ctx.counters
    inner = Scaled(NoParams(), ctx)
    shadow = Shadow(inner, ctx)
    assert shadow.p is inner.p and isinstance(shadow.ref.p, NoParams)
    own = shadow.ref.ctx.counters
    assert own is not c and (own.kv_heads, own.elem_bytes, own.cuda) == (HKV, 4, False)
    g = torch.Generator().manual_seed(7)
    q, k, v = _qkv(g, 4)
    shadow.prefill(0, q, k, v * 1e-4)
    c.step = 1
    shadow.decode(0, *_qkv(g, 1))
    inner.mask = torch.ones(1, HQ, 5, dtype=torch.bool)
    shadow.flush()
    wheres = {(qn, w) for qn, w, _, _ in c.series() if qn in ("rel_error", "topk_recall")}
    assert wheres == {("rel_error", "attention"), ("topk_recall", "attention")}
    assert _filed(c, "rel_error")[(0, 0)] == pytest.approx(1.0, rel=1e-5)
    # the run counts the strategy's prefill (4 tokens) and decode (5); the reference's
    # calls (4 + 5) go to its own counters, whose step stays 0
    assert (c.step_total("tokens", "accel", 0), c.step_total("tokens", "accel", 1)) == (4, 5)
    assert own.step_total("tokens", "accel", 0) == 9
