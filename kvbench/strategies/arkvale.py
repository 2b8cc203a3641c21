"""ArkVale page recall: a page budget on the accelerator, every page backed up on the host.

Chen et al., "ArkVale: Efficient Generative LLM Inference with Recallable Key-Value
Eviction" (NeurIPS 2024, sections 4-5), the baseline of CXL-PNM (its Algorithm 1 lines 1-6
and 10-11; spec sheet section 4). KV is cut into pages of S tokens (default 32). The
accelerator holds `--budget-tokens` worth of pages (default 4096 = 128 pages): the current
page (1..S tokens) plus a pool of C full pages. A page is completed, as in the authors'
code, when the token after its last arrives: it is backed up to the host (one d2h copy) and
summarised by a cuboid-mean digest (`_summarize_keys`); with the pool full it takes the
slot of the page leaving the window, which is evicted (`KvCache._decode_alloc_1_page`).
Whenever the context has more pages than the budget, every full page is scored with the
query after RoPE (`estimate.cu`: sum_i max(q_i hi_i, q_i lo_i)); the top set holds the
sinks, the window and k - sinks - (window - 1) pages by score, k + 1 pages in all (k =
`--pages`, ArkVale's `page_topks`); its missing pages are recalled from the host into the
slots of the lowest-scoring resident pages outside it (`select.cu`, Alg. 1 lines 2-6, 11);
attention runs over *all* resident pages (the budget, not only the top set). Prefill (and
a multi-turn append, kvbench's) attends densely, then cuts the pool to the budget by the
last query's scores over every head, with at least 2 sinks (`prefill_evict_extra_pages`).
The first `--dense-layers` layers keep every page (`n_unlimited_layers` 2).

Fidelity (pku-liang/ArkVale 0c3b45e; docs/fidelity/arkvale.md, tests/test_fidelity_arkvale.py):
variant `authors` shares one page set per layer, ranked by the mean over all query heads
(the code's default n_groups=1); `per-kv-head` keeps one set per KV head (n_groups = Hkv).
Not followed: scores and digests in fp32 (the code: the model dtype), ties, the optional
layer-ahead prefetch; window 1 (the code asserts window >= 2) leaves a completed page out
of the pool unless it is selected.

Recalled and evicted pages are counted per layer and step ("pages", "recalled"/"evicted",
summed over batch rows and KV heads), with the bytes they move (h2d) and the backups (d2h).
Exact setting: a budget covering the context (no page ever leaves the accelerator).

On the CPU, once every sparse layer's pool is full, a decode step runs in one native call
(kvbench.kernels.step; `native_cache`, `native_rule`, `decoded`): `native_rule` completes a
full current page in torch first (backup, digest, into the pool), then the call scores,
selects and recalls inside its region (probes/pages.c kvb_recall_in: the same rule, ties
aside; on the CPU the backup is host memory, so a recall is a copy and reads no id on the
host) and attends the pool and the current page as one span; the same pools, slots,
counters and stage graph as `decode` (tests/test_kernels_step.py).
The parameters and the pages (layout, backups, placement, recall):
kvbench.strategies._arkvale_pool.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbench.strategies import STRATEGIES, Strategy, position_mask
from kvbench.strategies._arkvale_pool import ArkValeParams, ArkValePool
from kvbench.strategies._hostcopy import transfer
from kvbench.strategies._pages import PAGES, check_layers

if TYPE_CHECKING:
    import ctypes

    import torch

    from kvbench.kernels.step import NativeCache, Recall
    from kvbench.runtime.context import RunContext


@STRATEGIES.register
class ArkVale(ArkValePool, Strategy):
    """ArkVale: page budget on the accelerator, pages recalled from host by digest score."""

    name = "arkvale"
    version = "3"
    params = ArkValeParams
    exact = (("budget_tokens", 1 << 20),)  # no page leaves the accelerator
    sparse = (("budget_tokens", 32), ("page_size", 8), ("sinks", 1), ("window_pages", 1))
    host_reads = (1, "the ids of the pages to recall from host memory (one nonzero per sparse "
                  "layer over the budget), as the authors' recall reads them")
    metrics = (PAGES,)

    @classmethod
    def placement(cls, params: ArkValeParams, ctx: RunContext) -> dict[str, int]:
        """Dense layers: k/v [B, Hkv, max_len, D] on the accelerator. Other layers: the pool
        k/v [B, Hkv, C + 1, S, D], digests lo/hi [B, Hkv, P_max, D] and slot_page int64
        [B, Hkv, C] on the accelerator; the host backup k/v [P_max, B, Hkv, S, D] and the
        recall staging k/v [B * Hkv * C, S, D] ("pinned" on CUDA: all of the host part)."""
        s, e, page = ctx.spec, ctx.elem_bytes, params.page_size
        heads = ctx.batch * s.n_kv_heads
        p_max, c = -(-ctx.max_len // page), cls.slots(params, ctx.max_len)
        dense = min(params.dense_layers, ctx.n_layers)
        sparse = ctx.n_layers - dense
        accel = (dense * 2 * heads * ctx.max_len * s.head_dim * e
                 + sparse * heads * (2 * (c + 1) * page * s.head_dim * e
                                     + 2 * p_max * s.head_dim * e + 8 * c))
        host = (sparse * p_max + (c if sparse else 0)) * 2 * heads * page * s.head_dim * e
        return {"accel": accel, "host": host, "pinned": host if ctx.accel.type == "cuda" else 0}

    def __init__(self, params: ArkValeParams, ctx: RunContext) -> None:
        super().__init__(params, ctx)
        check_layers(params.dense_layers, ctx.n_layers)
        self._init_pool(params, ctx)
        # the native step's: per sparse layer its (pages recalled, evicted), written by the
        # call, and (bytes backed up, pages evicted) of a page `native_rule` completed; its
        # pool as one cache [B, Hkv, (C + 1) S, D]
        self._moved: dict[int, ctypes.Array[ctypes.c_int64]] = {}
        self._flat: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._done: dict[int, tuple[float, float]] = {}

    def attended(self, layer: int) -> torch.Tensor | None:
        """Every resident page and the current one (all tokens while the pool holds all)."""
        import torch

        n, hq, size = self.length[layer], self.ctx.spec.n_heads, self.p.page_size
        nf = self._split(n)[0]
        if layer < self.p.dense_layers or nf <= self.c:
            return torch.ones(self.ctx.batch, hq, n, dtype=torch.bool, device=self.ctx.accel)
        sp = self.slot_page[layer]
        off = torch.arange(size, device=sp.device)
        pos = torch.cat([(sp[..., None] * size + off).flatten(2),
                         torch.arange(nf * size, n, device=sp.device).expand(
                             *sp.shape[:2], -1)], dim=2)
        return position_mask(pos, n, hq)

    def _dense(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """A dense layer: every token stays on the accelerator (n_unlimited_layers)."""
        from kvbench.kernels.attention import dense_attention

        n0 = self.length[layer]
        n1 = n0 + k.shape[2]
        self.k[layer][:, :, n0:n1], self.v[layer][:, :, n0:n1] = k, v
        self.length[layer] = n1
        out, _ = dense_attention(q, self.k[layer][:, :, :n1], self.v[layer][:, :, :n1])
        self.ctx.counters.attended("accel", q, n1)
        return out

    def append(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """T new tokens: dense causal attention over every cached page (the evicted ones
        read back from the host) and the new tokens, then back up the pages they complete
        and cut the pool down to the budget by the last query's scores over every head
        (ArkVale's prefill; a multi-turn append is kvbench's, by the same rule)."""
        import torch

        from kvbench.kernels.attention import dense_attention

        if layer < self.p.dense_layers:
            return self._dense(layer, q, k, v)
        size, c = self.p.page_size, self.c
        n0 = self.length[layer]
        nf, t = self._split(n0)
        seg_k = torch.cat([self.pool_k[layer][:, :, c, :t], k], dim=2)  # from page nf on
        seg_v = torch.cat([self.pool_v[layer][:, :, c, :t], v], dim=2)
        keys, vals = seg_k, seg_v
        counters = self.ctx.counters
        if nf:  # the completed pages, read from the host backup (contiguous, page-major)
            old = []
            for host in (self.host_k[layer], self.host_v[layer]):
                dev = torch.empty(host[:nf].shape, dtype=host.dtype, device=k.device)
                old.append(transfer(dev, host[:nf]).permute(1, 2, 0, 3, 4).flatten(2, 3))
            keys = torch.cat([old[0], seg_k], dim=2)
            vals = torch.cat([old[1], seg_v], dim=2)
            counters.moved("h2d", 2.0 * (nf - min(nf, c)) * k[:, :, :1].numel() * size
                           * self.ctx.elem_bytes)
        out, _ = dense_attention(q, keys, vals)
        counters.attended("accel", q, keys.shape[2])
        m = (seg_k.shape[2] - 1) // size  # pages completed: the last stays current
        b, hkv, _, d = k.shape
        fresh_k = seg_k[:, :, :m * size].reshape(b, hkv, m, size, d)
        fresh_v = seg_v[:, :, :m * size].reshape(b, hkv, m, size, d)
        rem = seg_k.shape[2] - m * size
        self.pool_k[layer][:, :, c, :rem] = seg_k[:, :, m * size:]
        self.pool_v[layer][:, :, c, :rem] = seg_v[:, :, m * size:]
        self.length[layer] = n0 + k.shape[2]
        if m:
            counters.moved("d2h", self._complete(layer, nf, fresh_k, fresh_v))
            with counters.timed("bookkeeping.select"):
                scores, target = (
                    self._select(layer, q[:, :, -1:], nf + m, c, self.p.prefill_sinks, True,
                                 append=True)
                    if nf + m > c else self._all(layer, nf + m))
                self._place(layer, scores, target, nf, fresh_k, fresh_v)
        return out

    prefill = append  # the first prompt: an append onto the empty cache

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """One token: a full current page is completed first (backup, digest, into the
        pool); when the context has more pages than the budget, the top set is made
        resident (recalls); the token goes into the current page; attention over every
        resident page and the current one."""
        from kvbench.kernels.attention import dense_attention, merge

        if layer < self.p.dense_layers:
            return self._dense(layer, q, k, v)
        size, c = self.p.page_size, self.c
        pk, pv = self.pool_k[layer], self.pool_v[layer]
        cur_k, cur_v = pk[:, :, c:c + 1], pv[:, :, c:c + 1]
        nf, t = self._split(self.length[layer])
        counters = self.ctx.counters
        with counters.timed("bookkeeping.select"):
            fresh = t == size
            if fresh:  # the token after a full page: complete it as page nf
                counters.moved("d2h", self._complete(layer, nf, cur_k, cur_v))
                evicted = self._enter(layer, nf, cur_k, cur_v)
                if evicted:
                    counters.add("pages", "evicted", evicted)
                nf, t = nf + 1, 0
            if nf > c:
                scores, target = self._select(layer, q, nf, self.p.topk, self.p.sinks,
                                              self.p.variant == "authors")
                # with a window of 2+ the completed page is resident already (`_enter`)
                first = nf - 1 if fresh and self.p.window_pages == 1 else nf
                self._place(layer, scores, target, first, cur_k, cur_v)
        pk[:, :, c, t], pv[:, :, c, t] = k[:, :, 0], v[:, :, 0]  # after: cur_k was read
        self.length[layer] += 1
        t += 1
        b, hkv, _, d = k.shape
        flat_k, flat_v = pk.view(b, hkv, -1, d), pv.view(b, hkv, -1, d)
        n_res = min(nf, c)
        counters.attended("accel", q, n_res * size + t)
        if n_res == c:  # slots 0..C-1 full, the current page follows in slot C
            n = c * size + t
            return dense_attention(q, flat_k[:, :, :n], flat_v[:, :, :n], causal=False)[0]
        o1, s1 = dense_attention(q, flat_k[:, :, :n_res * size], flat_v[:, :, :n_res * size],
                                 causal=False)
        cur = slice(c * size, c * size + t)
        o2, s2 = dense_attention(q, flat_k[:, :, cur], flat_v[:, :, cur], causal=False)
        return merge(o1, s1, o2, s2)[0]

    # --- the native step (kvbench.kernels.step) --------------------------------------

    def native_cache(self, layer: int) -> NativeCache:
        """A dense layer's cache; a sparse layer's pool as one cache [B, Hkv, (C + 1) S, D]
        (slot C, the current page, last), the token going to the current page's next row
        (its first once a pending full page is completed) and the pool and the current page
        attended: a span the step can take once the pool is full (`ok`), with the digests,
        slot_page and host backup its recall reads and writes."""
        from kvbench.kernels.step import NativeCache, moved

        n = self.length[layer]
        if layer < self.p.dense_layers:
            return NativeCache(self.k[layer], self.v[layer], n)
        nf, t = self._split(n)
        if t == self.p.page_size:  # completed by `native_rule` before the call
            nf, t = nf + 1, 0
        if layer not in self._flat:  # views made once: no op a step
            self._flat[layer] = (self.pool_k[layer].flatten(2, 3),
                                 self.pool_v[layer].flatten(2, 3))
        pk, pv = self._flat[layer]
        dig, at = self.dig[layer], self.c * self.p.page_size + t
        return NativeCache(pk, pv, n, dig.lo, dig.hi, slot=at,
                           span=at + 1, slot_page=self.slot_page[layer],
                           bk=self.host_k[layer], bv=self.host_v[layer],
                           moved=self._moved.setdefault(layer, moved()), ok=nf >= self.c)

    def native_rule(self, n: int) -> Recall:
        """Complete each sparse layer's full current page (backup, digest, into the pool, as
        `decode` does first), then the step's rule over the n - 1 cached tokens' pages."""
        from kvbench.kernels.step import Recall

        size, c = self.p.page_size, self.c
        nf, t = self._split(n - 1)
        fresh = t == size
        for layer in self.pool_k if fresh else ():
            cur_k, cur_v = self.pool_k[layer][:, :, c:c + 1], self.pool_v[layer][:, :, c:c + 1]
            self._done[layer] = (self._complete(layer, nf, cur_k, cur_v),
                                 self._enter(layer, nf, cur_k, cur_v))
        nf += fresh
        return Recall(size, c, nf, self.p.topk, self.p.sinks, self.p.window_pages - 1,
                      nf - 1 if fresh and self.p.window_pages == 1 else nf,
                      self.p.variant == "authors")

    def decoded(self, layer: int, q: torch.Tensor, select_s: float) -> None:
        """The token is in the current page, the top pages made resident and the pool
        attended: counted as `decode` counts (the backup, evictions, the digests read, the
        recalls' pages and bytes), its selection's and recall's seconds in the call as its
        "bookkeeping.select" (a page's completion, in torch before the call, is the step's
        dispatch)."""
        counters, size = self.ctx.counters, self.p.page_size
        n = self.length[layer] = self.length[layer] + 1
        if layer < self.p.dense_layers:
            counters.attended("accel", q, n)
            return
        nf, t = self._split(n)
        with counters.carried("bookkeeping.select", select_s):
            backed, evicted = self._done.pop(layer, (0.0, 0.0))
            if backed:
                counters.moved("d2h", backed)
            if nf > self.c:
                counters.add("bytes_read", "accel", self.dig[layer].nbytes(nf * size))
                recalled, out = self._moved[layer]
                evicted += out
                if recalled:
                    self._count_recalled(recalled, q.shape[-1])
            if evicted:
                counters.add("pages", "evicted", evicted)
        counters.attended("accel", q, self.c * size + t)
