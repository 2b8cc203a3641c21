"""HGCA: hybrid GPU-CPU attention (HGCA paper sections 3.2-3.3, Algorithms 1 and 2).

Per layer (Algorithm 1, section 3.2.1; state in strategies._hgca_kv) the accelerator holds
a ring of `window / block` KV blocks and a moving average of attention weights (MAW) per
resident entry and query head (factor alpha, line 8). When the ring is full after a step
(line 10) its oldest block is evicted: copied with its MAW to host memory (line 13) on a
side CUDA stream (a memcpy on a CPU-only machine, counted on the d2h link all the same).
A single host worker thread, off the critical path (section 3.2.2), appends the block to
KV_cpu and selects entries at threshold beta / W (lines 23-25; W = GPU-side entries, the
paper's A_gpu.size) into the contextual cache KV_ctx. `authors` (the default): per query
head its own top-k entries by MAW, k the largest count at or above the threshold among
its group of Hq // 4 adjacent heads (footnote 4's padding), at least 10 (`topk_keep`);
`union-ema`: per KV head the entries any of its query heads rates above it, attended by
the whole group (`union_keep`). For multi-head models (the paper's OPT) a union is per
head. beta = 0 selects every host entry (no sparsification): the hybrid result is then
exact, in both variants.

A decode step (Algorithm 2, section 3.3): dense attention over the resident window on
the accelerator, sparse attention of the query over each row's KV_ctx entries on the
host (kvbench.kernels.cpu: `threads` pthreads, adjacent heads merged per task as in the
paper's footnote 4), merged by log-sum-exp into the accelerator output. On CUDA the GPU
kernels are queued first, so the host part runs while they execute; on a CPU-only
machine both parts run on the CPU one after the other, and the accelerator role's wait
for the host part is what `accel_idle` records.

A prefill or a multi-turn append of T tokens (one method): dense causal attention of the
new queries over the resident window and the new tokens on the accelerator; for an
append, dense attention over all of KV_cpu on the host (exact), merged by lse. The window
and the new tokens get their MAW from that attention: `authors`, its column mean over the
new queries (`_hgca_kv.column_mean`); `union-ema`, line 8 applied once per new query, in
order (`_hgca_kv.ingest_maw`), as if the tokens had been decoded one by one. What no
longer fits the ring leaves in whole blocks at once (line 11). After an append the worker
re-evaluates KV_ctx from the host attention weights A_cpu (lines 19-21: the variant's
selection over KV_cpu of the mean weight over the appended queries, threshold
beta / |KV_cpu|), before it selects from the blocks this append evicted.

Lines 8-13 run off the critical path (strategies._hgca_manager, the base class: on CUDA a
side stream and the host worker; on a CPU-only machine how the roles map onto the cores).

Counters: attended accel (window) and host (mean selected entries per row; the bytes
read are the KV heads' KV_ctx copies, the union of their rows' entries); moved d2h
(evicted blocks, queries) and h2d (partial outputs); time phases on the critical path
"bookkeeping.issue" (queueing side-stream work and worker jobs), "bookkeeping.maw" and
"bookkeeping.evict" (CPU-only), "bookkeeping.handoff" (waiting for the worker),
"bookkeeping.merge", "accel_idle"; off it, worker seconds filed when joined:
"bookkeeping.select" and "bookkeeping.reselect"; prefill/append: "bookkeeping.scores"
(initial weights) and "bookkeeping.evict" (the overflow); tokens "host_resident" and
"host_selected.h{i}" (per KV_ctx row: query head for `authors`, KV head for `union-ema`;
summed over the batch) from which the selected fraction per row follows.

Fidelity (docs/fidelity/hgca.md; tests/test_fidelity_hgca.py): the `authors` variant
follows deng451e/beyond-ae at 55ec93174a4b17265178e0a967bdaa42802c0340,
beyond/KVcache_manager.py (add_cache, decode_update, append_update, distill) and
beyond/attention_methods.py (hybrid_decode, hybrid_append), the paper's Algorithms 1-2
(sections 3.2-3.3). Differences, each selectable or not:

| aspect | artifact | kvbench `authors` | selectable |
|---|---|---|---|
| GQA | none (multi-head only) | per query head, its KV head's entries | no |
| host selection | per head top-k, k: group max, >= 10 | the same | union-ema: KV-head union |
| prefill scores | column mean, beta / (n + T) | the same | union-ema: EMA, beta / W |
| new entry's MAW | its first weight | the same | union-ema: from 0 |
| re-selection | on an append that evicts | the same | union-ema: every append |
| k over the entries | topk raises | clamped to the entries | no |
| groups, batch > 1 | over (batch, head) rows | within a sequence | no (same at batch 1) |
| alpha, beta | runs: 0.5-0.9, 0.5-1 | 0.003, 1.0 | --alpha, --beta |
| dtype | fp16 MAW and KV | fp32 MAW, model-dtype KV | no |
| KV_ctx | a copy per head of its entries | a copy per KV head of its rows' union, masked | no |
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvbench.runtime.breakdown import Metric, PerLayer
from kvbench.schema import ParamValue, Record, measured
from kvbench.strategies import STRATEGIES
from kvbench.strategies._hgca_kv import (
    BLOCK,
    MIN_BLOCKS,
    HgcaParams,
    LayerKV,
    column_mean,
    host_threads,
    ingest_maw,
)
from kvbench.strategies._hgca_manager import HgcaManager
from kvbench.strategies._hostcopy import to_host

if TYPE_CHECKING:
    import torch

    from kvbench.runtime.context import RunContext


def selected_fraction(name: str, params: dict[str, ParamValue],
                      per_layer: PerLayer) -> Iterator[Record]:
    """Selected share of the host-resident entries per (layer, KV_ctx row), summed over the
    decode steps (`_count_selected`'s "host_selected.h*" and "host_resident" tokens)."""
    resident = {layer: sum(v) for (q, w, layer), v in per_layer.items()
                if q == "tokens" and w == "host_resident"}
    fractions = [sum(v) / resident[layer] for (q, w, layer), v in sorted(per_layer.items())
                 if q == "tokens" and w.startswith("host_selected.") and resident.get(layer)]
    if fractions:
        yield measured("run", name, "selected_fraction", "ratio", "none", fractions, params,
                       {"per": "(layer, KV head): selected / host-resident entries",
                        "statistic": "median", "min": min(fractions), "max": max(fractions)})


@STRATEGIES.register
class Hgca(HgcaManager):
    """HGCA: dense attention on a GPU ring window + per-head sparse attention on the host."""

    name = "hgca"
    version = "5"  # 5: variants, `authors` (the artifact's rules) the default
    params = HgcaParams
    exact = (("beta", 0.0),)  # every host entry selected (section 3.2.2)
    sparse = ()  # its defaults: beta 1, a window a quarter of the context
    metrics = (Metric("selected_fraction", "ratio", reduction="own", of="tokens",
                      derive=selected_fraction),)

    @classmethod
    def for_run(cls, params: HgcaParams, max_len: int) -> tuple[HgcaParams, list[str]]:
        """Resolve --block 0 (the largest power of two up to BLOCK whose window holds at
        least MIN_BLOCKS blocks, else the largest that divides the window) and record the
        window's blocks; a window under MIN_BLOCKS blocks is warned about: the ring then
        evicts most of what it holds at once. --cpu-threads 0 becomes `host_threads` (CUDA
        present: the run's automatic device is the GPU)."""
        import torch

        if not params.cpu_threads:
            params = replace(params, cpu_threads=host_threads(torch.cuda.is_available()))
        block = params.block
        if not block:
            fits = [b for b in (BLOCK >> i for i in range(BLOCK.bit_length()))
                    if not params.gpu_tokens or params.gpu_tokens % b == 0]
            block = next((b for b in fits if replace(params, block=b).tokens(max_len)
                          >= MIN_BLOCKS * b), fits[0])
        p = replace(params, block=block)
        w = p.window(max_len)
        p = replace(p, window_blocks=w // block)
        if p.window_blocks >= MIN_BLOCKS or w >= max_len:
            return p, []
        return p, [f"hgca's accelerator window is {p.window_blocks} block(s) of {block} "
                   f"tokens ({w} of {max_len}): outside the paper's regime of a ring of "
                   f"several blocks (at least {MIN_BLOCKS}); pass a smaller --block, a larger "
                   "--gpu-share or a longer --prompt-len"]

    @classmethod
    def placement(cls, params: HgcaParams, ctx: RunContext) -> dict[str, int]:
        """Per layer (LayerKV.nbytes): ring k/v and MAW on the accelerator; KV_cpu and KV_ctx
        (float32 for a float16 model), eviction staging and output buffers on the host;
        plus the host kernel's row index [B * Hkv, max_len] and the wrapped ring's selection
        ([B * Hkv, 2 W] and [W + 1, B * Hkv]), int32. "pinned": the staging and output
        buffers (LayerKV.pinned), part of "host"."""
        p, _ = cls.for_run(params, ctx.max_len)
        w = p.window(ctx.max_len)
        accel, host = LayerKV.nbytes(ctx, w, p.block, cls.rows(p, ctx))
        index = ctx.batch * ctx.spec.n_kv_heads * (ctx.max_len + 3 * w + 1) * 4
        return {"accel": ctx.n_layers * accel, "host": ctx.n_layers * host + index,
                "pinned": ctx.n_layers * LayerKV.pinned(ctx, p.block)}

    # -- Algorithm 2: hybrid attention -------------------------------------------------------

    def _window(self, L: LayerKV, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense attention over the resident slots: one range, or when the ring wraps two
        ranges merged, or on the CPU's native kernel the wrapped slots as one selection."""
        from kvbench.kernels import cpu
        from kvbench.kernels.attention import dense_attention, merge
        from kvbench.kernels.sparse import Selection, sparse_attention

        ranges = L.resident()
        if len(ranges) == 2 and cpu.native_ok(q):  # slots tail .. tail + n (mod W)
            sel = Selection(self.ring_idx[:, L.tail:L.tail + L.n].contiguous(),
                            self.ring_lens[L.n], self.w)
            return sparse_attention(q, L.gk, L.gv, sel, causal=False)
        parts = [dense_attention(q, k, v, causal=False) for k, v, _ in ranges]
        return parts[0] if len(parts) == 1 else merge(*parts[0], *parts[1])

    def _to_host(self, L: LayerKV, q: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The queries on the host and, on CUDA, the event that says they have landed: the
        copy is queued without blocking before the window's attention (pinned; GPU audit
        finding 14), so the accelerator runs the window while the host waits for q
        (`_host`); the stage graph's "host" fork beside the accelerator window."""
        with self.ctx.counters.fork("host"):
            self.ctx.counters.moved("d2h", q.numel() * q.element_size())
        (qh,), landed = to_host(self.ctx.host, q.to(dtype=L.hk.dtype))
        return qh, landed

    @staticmethod
    def _arrived(sent: tuple[torch.Tensor, Any]) -> torch.Tensor:
        """The host's copy of q once `_to_host`'s copy has landed (its event waited for)."""
        qh, landed = sent
        if landed is not None:
            landed.synchronize()
        return qh

    def _host(self, L: LayerKV, q: torch.Tensor, qh: tuple[torch.Tensor, Any] | None
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Sparse attention of qh (q copied to the host, and the event of its copy:
        `_to_host`) over each row's KV_ctx on the host thread pool (line 12): one pass over
        each KV head's copy (the longest's entries, `L.sizes`) for its query group, a query
        head skipping what it did not select (`ckeep`); None when no entry is selected."""
        from kvbench.kernels.sparse import Selection, sparse_attention

        if qh is None:
            return None
        qh = self._arrived(qh)
        c = self.ctx.counters
        if L.out is None:
            from kvbench.kernels.cpu import output_buffers

            L.out, L.lse = output_buffers(qh)  # pinned on CUDA: read in place by the merge
        elif L.merged is not None:  # the last step's merge read them with an async H2D
            L.merged.synchronize()  # (GPU audit finding 15): done before the rewrite
            L.merged = None
        umax, mean, union, _ = L.sizes
        sel = Selection(self.idx[:, :umax], L.ulens, umax)  # copy row r: its first ulens[r]
        keep = None if L.ckeep is None else L.ckeep[:, :, :umax]
        out, lse = sparse_attention(qh, L.ck[:, :, :umax], L.cv[:, :, :umax], sel,
                                    causal=False, scale=self.scale, threads=self.p.cpu_threads,
                                    out=L.out, lse=L.lse, keep=keep)
        b, hq, _, d = q.shape
        with c.fork("host"):  # tokens per row; bytes: the KV heads' copies (their unions)
            c.attention("host", b * mean, 4.0 * b * hq * mean * d,
                        2.0 * union * d * c.elem_bytes, q.numel() * c.elem_bytes)
            c.moved("h2d", out.numel() * out.element_size() + lse.numel() * 4)
        return out, lse

    def _count_selected(self, L: LayerKV, b: int) -> None:
        """Host-resident and selected tokens (per KV_ctx row: query head for `authors`, KV
        head for `union-ema`; summed over the batch) of a decode step: every step with host
        entries, those that select none included."""
        c = self.ctx.counters
        c.add("tokens", "host_resident", b * L.n_host)
        for h, n in enumerate(L.sizes.per_row):
            c.add("tokens", f"host_selected.h{h}", n)

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """Prefill (empty layer) or append of T tokens: q [B, Hq, T, D], k/v [B, Hkv, T, D]
        -> causal attention [B, Hq, T, D] over the window, the new tokens and (append)
        all of KV_cpu; then new MAW, overflow eviction and (append) re-evaluation.
        `authors`: the MAW is the column mean of this attention (`column_mean`), the
        overflow is selected at beta / (n + T) and KV_cpu re-evaluated only when the append
        evicts (beyond-ae's add_cache starts its append thread only then); `union-ema`: the
        decode average replayed (`ingest_maw`), beta / W, re-evaluated at every append."""
        import torch

        from kvbench.kernels.attention import dense_attention, merge

        L = self.layers[layer]
        c = self.ctx.counters
        self._join(L)
        self._await_side(L)
        n, t = L.n, k.shape[2]
        parts = L.resident()
        keys = torch.cat([p[0] for p in parts] + [k], dim=2)  # [B, Hkv, n + T, D], oldest first
        vals = torch.cat([p[1] for p in parts] + [v], dim=2)
        old = torch.cat([p[2] for p in parts], dim=2)
        nh = L.n_host
        sent = self._to_host(L, q) if nh else None
        out, lse = dense_attention(q, keys, vals, q_start=n)
        c.attended("accel", q, n + t)
        m = n + t
        evict = math.ceil((m - self.w + 1) / self.p.block) * self.p.block if m >= self.w else 0
        if sent is not None:  # the host part is exact: every KV_cpu entry
            with c.timed("accel_idle"):
                qh = self._arrived(sent)
                host = dense_attention(qh, L.hk[:, :, :nh], L.hv[:, :, :nh], causal=False,
                                       scale=self.scale, threads=self.p.cpu_threads)
            with c.fork("host"):
                c.attended("host", q, nh)
                c.moved("h2d", host[0].numel() * host[0].element_size()
                        + host[1].numel() * 4)
            c.join()
            with c.timed("bookkeeping.merge"):
                out, _ = merge(out, lse, *host)
            if evict or not self.authors:
                self._submit(L, self._reselect, qh, host[1], nh)
        if self.ctx.max_len <= self.w:  # no token will leave the window: no MAW needed
            maw = L.maw.new_zeros(q.shape[0], q.shape[1], m)
        elif self.authors:
            with c.timed("bookkeeping.scores"):
                maw = column_mean(q, keys, lse, n, scale=self.scale)
        else:
            with c.timed("bookkeeping.scores"):
                maw = ingest_maw(q, keys, lse, n, old, alpha=self.p.alpha, w=self.w,
                                 scale=self.scale)
        r = m - evict
        L.gk[:, :, :r] = keys[:, :, evict:]
        L.gv[:, :, :r] = vals[:, :, evict:]
        L.maw[:, :, :r] = maw[:, :, evict:]
        L.n, L.tail = r, 0
        if evict:
            self._evict(L, keys[:, :, :evict], vals[:, :, :evict], maw[:, :, :evict],
                        m if self.authors else self.w)
        return out

    append = prefill  # a later turn's prompt: the same path onto a non-empty layer

    def attended(self, layer: int) -> torch.Tensor:
        """The last decode step's positions, bool [B, Hq, n]: the resident window (the
        newest entries) and, per query head, the KV_ctx entries of its row then
        (the step's own eviction, still being selected, adds only newer positions)."""
        import torch

        L = self.layers[layer]
        self._join(L)
        nh, nw = L.seen
        rows = L.lens.numel()
        mask = torch.zeros(rows, nh + nw, dtype=torch.bool)
        mask[:, nh:] = True
        n = int(L.lens.max()) if nh else 0
        pos = L.cpos[:, :n].long()
        valid = (torch.arange(n) < L.lens[:, None]) & (pos < nh)
        mask[valid.nonzero(as_tuple=True)[0], pos[valid]] = True
        b, hq = self.ctx.batch, self.ctx.spec.n_heads
        r = rows // b
        return mask.view(b, r, 1, -1).expand(b, r, hq // r, -1).reshape(b, hq, -1).to(
            self.ctx.accel)

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        import torch

        from kvbench.kernels.attention import merge

        L = self.layers[layer]
        c = self.ctx.counters
        self._join(L)  # KV_ctx complete for this layer (the paper's per-layer sync)
        self._await_side(L)  # MAW updated, evicted slots free
        slot = (L.tail + L.n) % self.w  # line 9: insert at the head of the ring
        L.gk[:, :, slot] = k[:, :, 0]
        L.gv[:, :, slot] = v[:, :, 0]
        L.maw[:, :, slot] = 0
        L.n += 1
        L.seen = (L.n_host, L.n)
        if L.n_host:
            self._count_selected(L, q.shape[0])
        qh = self._to_host(L, q) if L.sizes.longest else None
        out, lse_w = self._window(L, q)  # lse_w: the window softmax's normaliser (A_gpu)
        c.attended("accel", q, L.n)
        with c.timed("accel_idle"):
            host = self._host(L, q, qh)
        if host is not None:
            c.join()
            with c.timed("bookkeeping.merge"):
                out, _ = merge(out, lse_w, *host)
                if self.stream is not None:  # the next step's kernel rewrites out/lse
                    L.merged = torch.cuda.Event()
                    L.merged.record(torch.cuda.current_stream())
        full = L.n == self.w  # line 10: full after the append, evict the oldest block
        self._manage(L, q, lse_w, slot, L.tail if full else None)
        if full:
            L.tail = (L.tail + self.p.block) % self.w
            L.n -= self.p.block
        return out
