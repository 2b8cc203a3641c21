"""hgca's `authors` variant held against the HGCA artifact (issue 31).

`Beyond` below restates, in float64 and in this file's own words, the rules of
deng451e/beyond-ae at 55ec93174a4b17265178e0a967bdaa42802c0340 (beyond/KVcache_manager.py:
add_cache, decode_update, append_update, distill; beyond/attention_methods.py:
hybrid_decode, hybrid_append), for one layer, sequence by sequence:

- the ring holds fewer than W entries between steps; a prefill or append of T tokens onto
  n resident evicts the oldest floor((n + T - W + block) / block) blocks (none when
  n + T < W), a decode step that fills the ring its oldest block;
- a prefill or append gives the window and the new tokens the column mean of the new
  queries' causal attention over them (one softmax over the window and the new tokens);
  those it evicts are selected at threshold beta / (n + T);
- a decode step: resident entries' MAW <- (1 - alpha) MAW + alpha w, the new entry's MAW
  w (its own first weight), w the step's softmax over the window; an evicted block is
  selected at beta / W;
- selection: per query head, the count of entries whose weight is at or above the
  threshold; heads in groups of Hq // 4 adjacent heads; every head of a group keeps its
  own top max(10, the group's largest count) entries (at most all of them);
- an append that evicts first re-selects KV_ctx from the mean host softmax of its queries
  over every host entry (threshold beta / host entries), then adds the evicted; one that
  does not evict leaves KV_ctx alone;
- a decode query attends the window (and itself) and its own KV_ctx, one softmax.

The artifact is multi-head only (its manager has one row per query head); with GQA a query
head reads its KV head's entries, the per-query-head generalisation the `authors` variant
runs. Tests compare the selected host positions per query head after every call and the
outputs, on random tensors with 9 query heads over 3 KV heads (groups of 2 straddle KV
heads), a prompt not a multiple of the block, decode steps and appends.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_usage_error, cli

from kvbench.models import get_spec
from kvbench.runtime.context import Counters, RunContext
from kvbench.strategies import STRATEGIES
from kvbench.strategies.hgca import Hgca, HgcaParams

SPEC = get_spec("smollm2-135m")  # 9 query heads over 3 KV heads, head dim 64
HQ, HKV, D = SPEC.n_heads, SPEC.n_kv_heads, SPEC.head_dim
G = HQ // HKV


class Beyond:
    """The artifact's rules for one layer of B sequences (float64, lists of positions)."""

    def __init__(self, b: int, w: int, block: int, beta: float, alpha: float,
                 keep_min: int = 10) -> None:
        self.w, self.block, self.beta, self.alpha, self.keep_min = w, block, beta, alpha, keep_min
        self.k = torch.empty(b, HKV, 0, D, dtype=torch.float64)  # every token, in order
        self.v = torch.empty_like(self.k)
        self.ring: list[list[int]] = [[] for _ in range(b)]  # resident positions, oldest first
        self.maw: list[dict[int, torch.Tensor]] = [{} for _ in range(b)]  # position -> [Hq]
        self.host: list[list[int]] = [[] for _ in range(b)]
        self.ctx: list[list[set[int]]] = [[set() for _ in range(HQ)] for _ in range(b)]

    def pick(self, a: torch.Tensor, threshold: float) -> list[list[int]]:
        """distill per group: a [Hq, n] -> per query head the indices it keeps."""
        n = a.shape[1]
        count = (a >= threshold).sum(dim=1).tolist()
        size = max(1, HQ // 4)
        out: list[list[int]] = []
        for g0 in range(0, HQ, size):
            heads = range(g0, min(HQ, g0 + size))
            k = min(n, max(self.keep_min, max(count[h] for h in heads)))
            for h in heads:
                out.append(sorted(range(n), key=lambda j, h=h: (-float(a[h, j]), j))[:k])
        return out

    def softmax(self, i: int, q: torch.Tensor, h: int, pos: list[int]) -> torch.Tensor:
        """Query head h's weights over positions pos of sequence i, q [D] float64."""
        return torch.softmax(self.k[i, h // G, pos] @ q * D ** -0.5, dim=0)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """A prefill or append of T tokens, q [B, Hq, T, D], k/v [B, Hkv, T, D]."""
        q = q.double()
        first, t = self.k.shape[2], q.shape[2]
        self.k = torch.cat([self.k, k.double()], dim=2)
        self.v = torch.cat([self.v, v.double()], dim=2)
        for i, ring in enumerate(self.ring):
            window = ring + list(range(first, first + t))
            m = len(window)
            a_gpu = torch.zeros(HQ, m, dtype=torch.float64)
            a_cpu = torch.zeros(HQ, len(self.host[i]), dtype=torch.float64)
            for h in range(HQ):
                for j in range(t):
                    a_gpu[h, :len(ring) + j + 1] += self.softmax(i, q[i, h, j], h,
                                                                 window[:len(ring) + j + 1])
                    if self.host[i]:
                        a_cpu[h] += self.softmax(i, q[i, h, j], h, self.host[i])
            a_gpu /= t
            a_cpu /= t
            evict = (m - self.w + self.block) // self.block * self.block if m >= self.w else 0
            if evict:
                if self.host[i]:
                    chosen = self.pick(a_cpu, self.beta / len(self.host[i]))
                    self.ctx[i] = [{self.host[i][j] for j in c} for c in chosen]
                for h, c in enumerate(self.pick(a_gpu[:, :evict], self.beta / m)):
                    self.ctx[i][h] |= {window[j] for j in c}
                self.host[i] += window[:evict]
            self.ring[i] = window[evict:]
            self.maw[i] = {p: a_gpu[:, evict + j] for j, p in enumerate(self.ring[i])}

    def decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One decode step -> its output [B, Hq, 1, D] float64."""
        q = q.double()
        p = self.k.shape[2]
        self.k = torch.cat([self.k, k.double()], dim=2)
        self.v = torch.cat([self.v, v.double()], dim=2)
        out = torch.empty(q.shape[0], HQ, 1, D, dtype=torch.float64)
        for i, ring in enumerate(self.ring):
            ring.append(p)
            w = torch.stack([self.softmax(i, q[i, h, 0], h, ring) for h in range(HQ)])
            for h in range(HQ):
                pos = ring + sorted(self.ctx[i][h])
                out[i, h, 0] = self.softmax(i, q[i, h, 0], h, pos) @ self.v[i, h // G, pos]
            for j, x in enumerate(ring[:-1]):
                self.maw[i][x] = (1 - self.alpha) * self.maw[i][x] + self.alpha * w[:, j]
            self.maw[i][p] = w[:, -1]
            if len(ring) == self.w:
                old = ring[:self.block]
                a = torch.stack([self.maw[i].pop(x) for x in old], dim=1)
                for h, c in enumerate(self.pick(a, self.beta / self.w)):
                    self.ctx[i][h] |= {old[j] for j in c}
                self.host[i] += old
                del ring[:self.block]
        return out


def dense(ref: Beyond, q: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last T tokens' queries q [B, Hq, T, D] over every token."""
    n, t = ref.k.shape[2], q.shape[2]
    k = ref.k.repeat_interleave(G, dim=1)
    logits = q.double() @ k.transpose(-1, -2) * D ** -0.5
    mask = torch.arange(n) > torch.arange(n - t, n)[:, None]
    return torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1) @ \
        ref.v.repeat_interleave(G, dim=1)


def selected(s: Hgca) -> list[list[set[int]]]:
    """The host positions each (sequence, query head) attends (its KV_ctx row: its own, or
    its KV head's under `union-ema`), the strategy's jobs joined."""
    L = s.layers[0]
    s._join(L)
    r = L.lens.numel() // s.ctx.batch  # rows per sequence
    return [[set(L.cpos[i * r + h // (HQ // r), :int(L.lens[i * r + h // (HQ // r)])].tolist())
             for h in range(HQ)] for i in range(s.ctx.batch)]


def run(params: HgcaParams, plan: list[tuple[int, int]], *, b: int = 2, max_len: int = 128,
        seed: int = 0) -> tuple[Hgca, Beyond, float, int]:
    """Feed turns (prompt, decode steps) to the strategy and the transcription; every call
    the same selected positions per query head; (strategy, transcription, worst output
    difference, host entries selected short of all at some point)."""
    cpu = torch.device("cpu")
    ctx = RunContext(SPEC, 1, b, max_len, torch.float32, cpu, cpu, Counters(HKV, 4))
    s = STRATEGIES.get("hgca")(params, ctx)
    ref = Beyond(b, s.w, s.p.block, params.beta, params.alpha, params.keep_min)
    gen = torch.Generator().manual_seed(seed)
    worst, partial = 0.0, 0
    for t, steps in plan:
        for size in [t] + [1] * steps:
            q = torch.randn(b, HQ, size, D, generator=gen)
            k, v = (torch.randn(b, HKV, size, D, generator=gen) for _ in range(2))
            first = ref.k.shape[2] == 0
            if size > 1:
                out = (s.prefill if first else s.append)(0, q, k, v)
                ref.prefill(q, k, v)
                want = dense(ref, q)
            else:
                out = s.decode(0, q, k, v)
                want = ref.decode(q, k, v)
            worst = max(worst, float((out.double() - want).abs().max()))
            got = selected(s)
            assert got == ref.ctx
            assert s.layers[0].n_host == len(ref.host[0])
            partial += sum(0 < len(c) < len(ref.host[i]) for i in range(b) for c in got[i])
    return s, ref, worst, partial


@pytest.mark.parametrize("keep_min, block, window", [(3, 8, 24), (10, 16, 32)])
def test_authors_selects_what_the_artifact_selects(keep_min: int, block: int,
                                                   window: int) -> None:
    """Beta 1, a 37-token prompt (not a multiple of the block: the prefill evicts whole
    blocks), decode steps that evict blocks, an append that evicts (re-selection) and a
    2-token one that does not: the same KV_ctx per query head after every call, outputs equal to the
    transcription's within fp32 tolerance, and the selection is partial."""
    params = HgcaParams(gpu_tokens=window, block=block, beta=1.0, alpha=0.2,
                        keep_min=keep_min)
    _, ref, worst, partial = run(params, [(37, 30), (20, 6), (2, 12)])
    assert ref.host[0] and partial > 0
    assert worst < 2e-5


def test_selection_rule_at_ties_and_the_floor() -> None:
    """The rule alone on weights built to sit exactly at the threshold (1/16: counted, the
    artifact compares with >=) and to tie (the earlier position first), groups of 2
    adjacent heads, a floor above and below the counts, a floor above the entries."""
    from kvbench.strategies._hgca_kv import topk_keep

    gen = torch.Generator().manual_seed(5)
    w = (torch.randint(0, 5, (2, HQ, 12), generator=gen) / 32).float()  # 0 .. 1/8, ties
    w[0, 4, :5] = 1 / 16
    for floor in (0, 3, 10, 20):
        ref = Beyond(2, 16, 8, 1.0, 0.1, keep_min=floor)
        got = topk_keep(w, 1 / 16, 4, floor)
        for i in range(2):
            want = ref.pick(w[i].double(), 1 / 16)
            assert [sorted(got[i, h].nonzero().flatten().tolist()) for h in range(HQ)] == \
                [sorted(c) for c in want]


def test_beta0_selects_every_host_entry_and_is_dense() -> None:
    """Beta 0: every host entry of every query head selected, outputs equal dense
    attention (the declared exact setting of the default variant)."""
    s, ref, worst, partial = run(HgcaParams(gpu_tokens=16, block=8, beta=0.0), [(21, 25),
                                                                                 (9, 5)])
    assert Hgca.exact == (("beta", 0.0),) and s.p.variant == "authors"
    assert partial == 0 and all(len(c) == len(ref.host[0]) for c in selected(s)[0])
    assert worst < 2e-5


def test_share_covering_the_context_is_dense() -> None:
    """GPU share 1: the ring holds the whole context, nothing is ever selected or needed;
    outputs equal dense attention."""
    s, _, worst, _ = run(HgcaParams(gpu_share=1.0, beta=1.0), [(20, 19)], max_len=40)
    assert s.w == 40 and worst < 2e-5
    assert all(not c for row in selected(s) for c in row)


def test_union_ema_is_not_the_artifact() -> None:
    """`union-ema` (kvbench's earlier rules, tests/test_offload_strategies.py and
    test_hgca_append.py hold it to them) keeps one KV_ctx per KV head, attended by its
    whole group: on the same inputs its selection is not the artifact's."""
    params = HgcaParams(variant="union-ema", gpu_tokens=24, block=8, beta=1.0, alpha=0.2)
    with pytest.raises(AssertionError, match="assert \\[\\["):
        run(params, [(37, 10)], b=1, max_len=64)


def test_unknown_variant_exits_2_naming_the_variants(capsys, tmp_path: Path) -> None:
    for extra, message in ((["--variant", "nope"], "--variant 'nope': unknown"),
                           (["--variant", "union-ema", "--keep-min", "3"],
                            "--keep-min is not a parameter of variant 'union-ema'")):
        assert_usage_error(cli(["run", "hgca", *extra, "--model", "opt-125m", "--weights",
                                "random", "--layers", "1", "--prompt-len", "200", "--gen-len",
                                "8", "--out", str(tmp_path / "x.jsonl")], capsys),
                           message, "(variants: authors, union-ema)")
