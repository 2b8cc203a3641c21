"""hgca decode at beta > 0 against an independent reference (issue 11 item 7): each step's
output equals softmax attention computed directly over the resident window (plus the new
token) and each row's KV_ctx, on the CPU and, on a GPU, with the side stream's MAW updates
and eviction copies ordered before the next step reads or writes the ring."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES

from kvbench.models import get_spec
from kvbench.runtime.context import Counters, RunContext
from kvbench.strategies import STRATEGIES
from kvbench.strategies.hgca import HgcaParams

SPEC = get_spec("smollm2-135m")  # GQA: 9 query heads over 3 KV heads, head dim 64


def reference(s, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> torch.Tensor:
    """What decode(layer, q, k, v) must return [B, Hq, 1, D], from the state it will read:
    per (sequence, query head), one softmax over the window's keys, the new key and the
    head's KV_ctx row (its own for `authors`, its KV head's for `union-ema`), in float64
    on the host."""
    L = s.layers[layer]
    s._join(L)  # KV_ctx as this step reads it (decode joins the same jobs first)
    if q.is_cuda:
        torch.cuda.synchronize()
    keys = torch.cat([p[0] for p in L.resident()] + [k], dim=2).double().cpu()
    vals = torch.cat([p[1] for p in L.resident()] + [v], dim=2).double().cpu()
    qd = q.double().cpu()
    b, hq, _, d = q.shape
    g = hq // k.shape[1]
    rows = L.lens.numel() // b  # KV_ctx rows per sequence
    out = torch.empty(b, hq, 1, d, dtype=torch.float64)
    for i in range(b):
        for h in range(hq):
            kh, r = h // g, h // (hq // rows)
            n = int(L.lens[i * rows + r])
            pos = L.cpos[i * rows + r, :n].long()
            kk = torch.cat([keys[i, kh], L.hk[i, kh, pos].double()])
            vv = torch.cat([vals[i, kh], L.hv[i, kh, pos].double()])
            w = torch.softmax(kk @ qd[i, h, 0] * d ** -0.5, dim=0)
            out[i, h, 0] = w @ vv
        for kh in range(k.shape[1]):  # a KV head's copy holds each entry of its rows once
            mine = range(kh * rows // k.shape[1], (kh + 1) * rows // k.shape[1])
            union = {p for r in mine for p in L.cpos[i * rows + r, :int(L.lens[i * rows + r])]
                     .tolist()}
            u = int(L.ulens[i * k.shape[1] + kh])
            assert u == len(union)  # the copy: those entries, in position order
            assert torch.equal(L.ck[i, kh, :u], L.hk[i, kh, sorted(union)])
            assert torch.equal(L.cv[i, kh, :u], L.hv[i, kh, sorted(union)])
            for h in range(kh * g, (kh + 1) * g) if L.ckeep is not None else ():
                mine = L.cpos[i * rows + h, :int(L.lens[i * rows + h])].tolist()
                assert L.ckeep[i, h, :u].tolist() == [p in mine for p in sorted(union)]
    return out


@pytest.mark.parametrize("variant", ["authors", "union-ema"])
@pytest.mark.parametrize("device", DEVICES)
def test_hgca_decode_at_beta_1_equals_window_plus_kv_ctx(device: str, variant: str) -> None:
    """40-token prompt, 39 decode steps, a 16-token ring of 8-token blocks (it wraps and
    evicts every 8 steps), beta 1, alpha 0.1: every output within 1e-4 of the reference,
    and the selection is partial (some host entries attended, not all)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    dev = torch.device(device)
    b, layers = 2, 2
    ctx = RunContext(SPEC, layers, b, 80, torch.float32, dev, torch.device("cpu"),
                     Counters(SPEC.n_kv_heads, 4, cuda=dev.type == "cuda"))
    s = STRATEGIES.get("hgca")(HgcaParams(variant=variant, gpu_tokens=16, block=8, beta=1.0,
                                          alpha=0.1), ctx)
    gen = torch.Generator().manual_seed(3)

    def qkv(t: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(b, h, t, SPEC.head_dim, generator=gen).to(dev)
                     for h in (SPEC.n_heads, SPEC.n_kv_heads, SPEC.n_kv_heads))

    q, k, v = qkv(40)
    for layer in range(layers):
        s.prefill(layer, q, k, v)
    worst, partial = 0.0, False
    for step in range(1, 40):
        q, k, v = qkv(1)
        s.begin_step(step)
        for layer in range(layers):
            ref = reference(s, layer, q, k, v)
            L = s.layers[layer]
            partial |= bool(((L.lens > 0) & (L.lens < L.n_host)).any())
            out = s.decode(layer, q, k, v)
            worst = max(worst, float((out.double().cpu() - ref).abs().max()))
    assert partial
    assert worst < 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_hgca_attended_mask_is_what_decode_attended(device: str) -> None:
    """Strategy.attended (eval mode's top-10 recall) against the output: each step's
    attention over the whole history [B, Hkv, n, D] restricted to the mask equals decode's
    output, through ring wraps and evictions (whose selection is still running when the
    mask is read); the mask holds the window and some, not all, host positions."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    dev = torch.device(device)
    b = 2
    ctx = RunContext(SPEC, 1, b, 80, torch.float32, dev, torch.device("cpu"),
                     Counters(SPEC.n_kv_heads, 4, cuda=dev.type == "cuda"))
    s = STRATEGIES.get("hgca")(HgcaParams(gpu_tokens=16, block=8, beta=1.0, alpha=0.1), ctx)
    gen = torch.Generator().manual_seed(4)
    d, g = SPEC.head_dim, SPEC.n_heads // SPEC.n_kv_heads

    def qkv(t: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(b, h, t, d, generator=gen).to(dev)
                     for h in (SPEC.n_heads, SPEC.n_kv_heads, SPEC.n_kv_heads))

    q, keys, vals = qkv(40)
    s.prefill(0, q, keys, vals)
    worst, host_some, host_all = 0.0, False, True
    for step in range(1, 30):
        q, k, v = qkv(1)
        s.begin_step(step)
        out = s.decode(0, q, k, v).double().cpu()
        keys, vals = torch.cat([keys, k], dim=2), torch.cat([vals, v], dim=2)
        mask = s.attended(0).cpu()
        n = keys.shape[2]
        assert mask.shape == (b, SPEC.n_heads, n) and mask[:, :, n - 16 + 8:].all()
        host = mask[:, :, :32]  # the prefill evicted 32 of its 40 tokens to the host
        host_some |= bool(host.any())
        host_all &= bool(host.all())
        kk = keys.double().cpu().repeat_interleave(g, dim=1)  # [B, Hq, n, D]
        vv = vals.double().cpu().repeat_interleave(g, dim=1)
        logits = (kk @ q.double().cpu().transpose(-1, -2)).squeeze(-1) * d ** -0.5
        w = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
        ref = (w[..., None] * vv).sum(dim=2, keepdim=True)
        worst = max(worst, float((out - ref).abs().max()))
    assert host_some and not host_all
    assert worst < 1e-4
