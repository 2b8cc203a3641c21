"""hgca multi-turn appends (HGCA Algorithm 1 lines 19-21): exact at beta 0, the ring and the
host cache stay consistent, and KV_cpu is re-evaluated from the host attention weights."""

from __future__ import annotations

import pytest
import torch

from kvbench.kernels.attention import dense_attention
from kvbench.models import get_spec
from kvbench.runtime.context import Counters, RunContext
from kvbench.strategies import STRATEGIES, supports_append
from kvbench.strategies.hgca import Hgca, HgcaParams

SPEC = get_spec("smollm2-135m")  # GQA: 9 query heads, 3 KV heads, head dim 64
D = SPEC.head_dim


def make(params: HgcaParams, batch: int = 2, max_len: int = 96) -> Hgca:
    cpu = torch.device("cpu")
    ctx = RunContext(SPEC, 1, batch, max_len, torch.float32, cpu, cpu,
                     Counters(SPEC.n_kv_heads, 4))
    return STRATEGIES.get("hgca")(params, ctx)


def chunk(gen: torch.Generator, t: int, batch: int = 2) -> tuple[torch.Tensor, ...]:
    """Random q [B, Hq, t, D], k/v [B, Hkv, t, D]."""
    return (torch.randn(batch, SPEC.n_heads, t, D, generator=gen),
            torch.randn(batch, SPEC.n_kv_heads, t, D, generator=gen),
            torch.randn(batch, SPEC.n_kv_heads, t, D, generator=gen))


def turns(s: Hgca, gen: torch.Generator, plan: list[tuple[int, int]]
          ) -> tuple[float, torch.Tensor]:
    """Feed (prompt, decode steps) turns to layer 0; (max |out - full attention|, every
    key fed [B, Hkv, N, D] in token order)."""
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    worst = 0.0
    for t, g in plan:
        for size in [t] + [1] * g:
            q, k, v = chunk(gen, size, s.ctx.batch)
            n = sum(x.shape[2] for x in ks)
            call = s.prefill if not ks else (s.decode if size == 1 else s.append)
            out = call(0, q, k, v)
            ks.append(k)
            vs.append(v)
            ref, _ = dense_attention(q, torch.cat(ks, dim=2), torch.cat(vs, dim=2), q_start=n)
            worst = max(worst, float((out - ref).abs().max()))
    return worst, torch.cat(ks, dim=2)


def test_hgca_supports_append() -> None:
    assert supports_append(Hgca)


@pytest.mark.parametrize("variant", ["authors", "union-ema"])
def test_beta0_multi_turn_equals_full_attention(variant: str) -> None:
    """Appends before and after the ring wraps, with a host part on every append."""
    s = make(HgcaParams(variant=variant, gpu_tokens=16, block=8, beta=0.0))
    plan = [(20, 10), (12, 9), (5, 7), (30, 2)]
    worst, keys = turns(s, torch.Generator().manual_seed(0), plan)
    assert worst < 2e-5
    s._join(s.layers[0])
    L = s.layers[0]
    # a T-token append onto n resident evicts whole blocks until n + T < 16, a decode step
    # that fills the ring evicts one: 20 -> 12 (+8 host), 10 steps -> 14 (+8); 12 -> 10
    # (+16), 9 steps -> 11 (+8); 5 -> 8 (+8), 7 steps -> 15; 30 -> 13 (+32), 2 steps -> 15
    assert (L.n, L.n_host) == (15, 80)
    assert torch.equal(L.hk[:, :, :80], keys[:, :, :80])  # KV_cpu: oldest tokens, in order
    assert torch.equal(torch.cat([p[0] for p in L.resident()], dim=2), keys[:, :, 80:])
    assert L.lens.tolist() == [L.n_host] * L.lens.numel()  # beta 0: every host entry


def test_append_reselects_from_host_weights() -> None:
    """Lines 19-21: after an append KV_ctx[row] holds exactly the KV_cpu entries whose
    mean host softmax weight over the appended queries exceeds beta / |KV_cpu| for some
    query head of the row's KV head, in KV_cpu order; selections made at eviction time
    that the appended queries do not confirm are dropped."""
    gen = torch.Generator().manual_seed(1)
    s = make(HgcaParams(variant="union-ema", gpu_tokens=32, block=8, beta=1.0), batch=1)
    turns(s, gen, [(24, 20)])  # ring: 24 + 8 -> evict 8, + 8 -> evict 8, + 4: 28 resident
    L = s.layers[0]
    s._join(L)
    assert (L.n, L.n_host) == (28, 16)
    hk = L.hk[:, :, :16].clone()
    q, k, v = chunk(gen, 3, batch=1)  # 28 + 3 < 32: nothing leaves the ring
    u = hk[0, 1, 5] / hk[0, 1, 5].norm()
    q[0, 3:6] = 10 * u  # KV head 1's query heads all look at host entry 5
    s.append(0, q, k, v)
    s._join(L)
    assert (L.n, L.n_host) == (31, 16)
    logits = q @ hk.repeat_interleave(3, dim=1).transpose(-1, -2) / 8  # [1, 9, 3, 16]
    a_cpu = logits.softmax(dim=-1).mean(dim=2).view(3, 3, 16).amax(dim=1)  # [3, 16]
    keep = a_cpu > 1.0 / 16
    assert bool(keep[1, 5]) and L.lens.tolist() == keep.sum(dim=1).tolist()
    for r in range(3):
        assert L.cpos[r, :int(L.lens[r])].tolist() == keep[r].nonzero().flatten().tolist()
    took = [x for q, w, _layer, st in s.ctx.counters.series() if q == "time"
            and w == "bookkeeping.reselect" for x in st.values()]
    assert took and all(0 < x < 60 for x in took)  # the worker's seconds, filed at the join


def test_ingest_maw_chunks_agree(monkeypatch) -> None:
    """The initial MAW computed in chunks of queries equals the one-chunk result, with
    resident entries (n > 0) decayed by (1 - alpha)^T."""
    from kvbench.strategies import _hgca_kv

    gen = torch.Generator().manual_seed(2)
    q, k, _ = chunk(gen, 12, batch=1)
    keys = torch.cat([torch.randn(1, 3, 5, D, generator=gen), k], dim=2)
    _, lse = dense_attention(q, keys, keys, q_start=5)
    old = torch.rand(1, 9, 5, generator=gen)
    kw = {"alpha": 0.05, "w": 16, "scale": D ** -0.5}
    whole = _hgca_kv.ingest_maw(q, keys, lse, 5, old, **kw)
    monkeypatch.setattr(_hgca_kv, "_SCORES", 9 * 17 * 2)  # two queries per chunk
    assert torch.allclose(_hgca_kv.ingest_maw(q, keys, lse, 5, old, **kw), whole, atol=1e-7)


def test_ingest_maw_of_uniform_attention_after_resident_entries() -> None:
    """Appending T tokens onto n resident ones with uniform attention (q = 0): a resident
    entry decays by (1 - alpha)^T and gains (1 - (1 - alpha)^T) / W, new token j gains
    (1 - (1 - alpha)^(T - j)) / W (uniform attention is 1 / W on the window's scale)."""
    from kvbench.strategies import _hgca_kv

    gen = torch.Generator().manual_seed(4)
    _, k, _ = chunk(gen, 12, batch=1)
    keys = torch.cat([torch.randn(1, 3, 5, D, generator=gen), k], dim=2)
    q = torch.zeros(1, 9, 12, D)
    _, lse = dense_attention(q, keys, keys, q_start=5)
    old = torch.rand(1, 9, 5, generator=gen)
    got = _hgca_kv.ingest_maw(q, keys, lse, 5, old, alpha=0.05, w=16, scale=D ** -0.5)
    decay = 0.95 ** 12
    assert torch.allclose(got[:, :, :5], old * decay + (1 - decay) / 16, atol=1e-7)
    j = torch.arange(12, dtype=torch.float64)
    assert torch.allclose(got[0, :, 5:].double(), ((1 - 0.95 ** (12 - j)) / 16).expand(9, 12),
                          atol=1e-7)


@pytest.mark.parametrize("alpha", [0.05, 1.0])
def test_ingest_maw_replays_the_moving_average_query_by_query(alpha: float) -> None:
    """Random queries (the scale matters): the MAW equals Alg. 1 line 8 replayed in float64
    one appended query at a time: MAW <- (1 - alpha) MAW, then + alpha p_ij (n + i + 1) / W
    for the n + i + 1 keys query i sees; alpha 1 keeps the last query's weights only."""
    from kvbench.strategies import _hgca_kv

    gen = torch.Generator().manual_seed(6)
    n, t, w, scale = 5, 7, 16, D ** -0.5
    q = torch.randn(1, 9, t, D, generator=gen)
    keys = torch.randn(1, 3, n + t, D, generator=gen)
    _, lse = dense_attention(q, keys, keys, q_start=n)
    old = torch.rand(1, 9, n, generator=gen)
    got = _hgca_kv.ingest_maw(q, keys, lse, n, old, alpha=alpha, w=w, scale=scale)
    ref = torch.zeros(1, 9, n + t, dtype=torch.float64)
    ref[:, :, :n] = old.double()
    kq = keys.double().repeat_interleave(3, dim=1)
    for i in range(t):
        seen = n + i + 1
        p = torch.softmax(q[:, :, i].double()[:, :, None, :] @ kq[:, :, :seen].transpose(-1, -2)
                          * scale, dim=-1)[:, :, 0]
        ref *= 1 - alpha
        ref[:, :, :seen] += alpha * p * seen / w
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-7)


def test_topk_keep_groups_of_one_head_keep_their_own_counts() -> None:
    """head_groups = Hq: every head is its own group, so each keeps as many entries as it
    has at or above the threshold (no floor), earlier positions first among equals."""
    from kvbench.strategies._hgca_kv import topk_keep

    weight = torch.tensor([[[0.9, 0.1, 0.8, 0.2], [0.1, 0.2, 0.3, 0.9], [0.6, 0.7, 0.8, 0.9],
                            [0.0, 0.0, 0.0, 0.1]]])
    keep = topk_keep(weight, 0.5, groups=4, floor=0)
    assert keep.dtype == torch.bool
    assert keep.sum(-1).tolist() == [[2, 1, 4, 0]]
    assert keep[0, 0].tolist() == [True, False, True, False]
    assert topk_keep(weight, None, 4, 0).dtype == torch.bool


def test_the_window_in_tokens_and_its_refusals() -> None:
    """The share's window in whole blocks; a cache of at most one block keeps one block
    (it is never evicted); a window that is not whole blocks, or smaller than one, is
    refused with one line."""
    from kvbench.errors import KvbenchError

    p = HgcaParams(gpu_share=0.25, block=8)
    assert (p.tokens(8), p.tokens(16), p.tokens(64)) == (8, 0, 16)
    assert HgcaParams(gpu_tokens=8, block=8).window(64) == 8
    with pytest.raises(KvbenchError, match="--block 8 does not divide the GPU window of 12"):
        HgcaParams(gpu_tokens=12, block=8).window(64)
    with pytest.raises(KvbenchError, match="a window of 0 tokens of 32 is less than one block"):
        HgcaParams(gpu_share=0.1, block=8).window(32)
