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

Lines 8-13 run off the critical path on CUDA: the MAW update and the eviction copy on the
side stream, the selection on the worker. On a CPU-only machine the accelerator role is
the calling thread, so it updates the MAW and copies the evicted block itself (cheap:
one [Hq, W] softmax and a block memcpy) and only the selection goes to the worker; a
second Python thread doing small tensor work beside the attention would only fight the
caller for the interpreter lock and the two cores. The worker's ops there run on its own
thread alone (kvbench.kernels.cpu.helper_thread: the paper's single host worker thread;
with two-thread OpenMP regions of its own it slowed the caller's every native call). Each
layer joins its worker jobs at its next step.

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
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvbench.runtime.breakdown import Metric, PerLayer
from kvbench.schema import ParamValue, Record, measured
from kvbench.strategies import STRATEGIES, Strategy, column_scores, decode_weights
from kvbench.strategies._hgca_kv import (
    BLOCK,
    MIN_BLOCKS,
    HgcaParams,
    LayerKV,
    column_mean,
    host_threads,
    ingest_maw,
    topk_keep,
    union_keep,
)
from kvbench.strategies._hostcopy import transfer

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
class Hgca(Strategy):
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

    @staticmethod
    def rows(params: HgcaParams, ctx: RunContext) -> int:
        """KV_ctx rows per sequence: one per query head (`authors`) or per KV head."""
        return ctx.spec.n_heads if params.variant == "authors" else ctx.spec.n_kv_heads

    def __init__(self, params: HgcaParams, ctx: RunContext) -> None:
        import torch

        from kvbench.kernels import cpu

        params, _ = self.for_run(params, ctx.max_len)
        super().__init__(params, ctx)
        self.authors = params.variant == "authors"
        self.w = params.window(ctx.max_len)
        rows = self.rows(params, ctx)
        self.layers = [LayerKV(ctx, self.w, params.block, rows) for _ in range(ctx.n_layers)]
        # the host kernel's selection over a KV head's copy: its first ulens entries
        rows_kv = ctx.batch * ctx.spec.n_kv_heads
        self.idx = torch.arange(ctx.max_len, dtype=torch.int32).repeat(rows_kv, 1)
        # a wrapped ring's resident slots as one selection (`_wrapped`): slot positions
        # twice over, and every row's length for each count of resident slots
        self.ring_idx = torch.arange(self.w, dtype=torch.int32).repeat(rows_kv, 2)
        self.ring_lens = torch.arange(self.w + 1, dtype=torch.int32)[:, None].repeat(1, rows_kv)
        self.worker = ThreadPoolExecutor(  # CPU-only: the worker's ops on itself alone
            max_workers=1, thread_name_prefix="hgca-select",
            initializer=None if ctx.accel.type == "cuda" else cpu.helper_thread)
        self.stream = torch.cuda.Stream(ctx.accel) if ctx.accel.type == "cuda" else None
        self.scale = ctx.spec.head_dim ** -0.5

    # -- Algorithm 1: KV manager -------------------------------------------------------------

    def _join(self, L: LayerKV) -> None:
        """Wait for the layer's worker jobs (hand-off) and file their phase times."""
        if not L.jobs:
            return
        c = self.ctx.counters
        with c.timed("bookkeeping.handoff", wait=True):
            took = [job.result() for job in L.jobs]
        L.jobs.clear()
        for phases in took:
            for phase, seconds in phases.items():
                c.add("time", f"bookkeeping.{phase}", seconds)

    def _submit(self, L: LayerKV, fn: Any, *args: Any) -> None:
        with self.ctx.counters.timed("bookkeeping.issue"):
            L.jobs.append(self.worker.submit(fn, L, *args))

    def _evict(self, L: LayerKV, k: torch.Tensor, v: torch.Tensor, maw: torch.Tensor,
               size: int) -> None:
        """Lines 11-13 then 23-25: copy k/v [B, Hkv, n, D] and MAW [B, Hq, n] to the host
        and hand the selection (threshold beta / size) to the worker. One block (a decode
        step's eviction) goes to the layer's pinned staging: on CUDA made contiguous in the
        host dtype on the side stream, then an async D2H (GPU audit finding 6). A prefill's
        or append's overflow (more than one block) is copied once, blocking, to fresh
        pageable buffers."""
        import torch

        c = self.ctx.counters
        src = (k, v, maw)
        with c.background():  # the next step's same layer joins it
            c.moved("d2h", (k.numel() + v.numel()) * k.element_size() + maw.numel() * 4)
        if k.shape[2] != L.sk.shape[2]:
            with c.timed("bookkeeping.evict"):
                staged = tuple(x.to("cpu", dt, copy=True) for x, dt in
                               zip(src, (L.hk.dtype, L.hk.dtype, torch.float32), strict=True))
            self._submit(L, self._select, *staged, size, None)
            return
        staged = (L.sk, L.sv, L.smaw)
        if self.stream is None:
            with c.timed("bookkeeping.evict"):
                for dst, x in zip(staged, src, strict=True):
                    transfer(dst, x.to(dst.dtype).contiguous())
            self._submit(L, self._select, *staged, size, None)
            return
        with c.timed("bookkeeping.issue"):
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for dst, x in zip(staged, src, strict=True):
                    transfer(dst, x.to(dst.dtype).contiguous())
                L.copied = L.side = torch.cuda.Event()
                L.copied.record(self.stream)
        self._submit(L, self._select, *staged, size, L.copied)

    def _manage(self, L: LayerKV, q: torch.Tensor, lse: torch.Tensor, slot: int,
                a: int | None) -> None:
        """Lines 8-13 after a decode step that wrote ring slot `slot`: MAW update, then (a:
        first slot of the oldest block, when the ring is full) its eviction. On CUDA the
        update goes on the side stream (the paper's per-buffer stream); on a CPU-only
        machine this thread does it."""
        import torch

        c = self.ctx.counters
        if self.stream is None:
            with c.timed("bookkeeping.maw"):
                self._update_maw(L, q, lse, slot)
        else:
            with c.timed("bookkeeping.issue"):
                self.stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.stream):
                    self._update_maw(L, q, lse, slot)
                    L.side = torch.cuda.Event()
                    L.side.record(self.stream)
                q.record_stream(self.stream)
                lse.record_stream(self.stream)
        if a is not None:
            e = a + self.p.block
            self._evict(L, L.gk[:, :, a:e], L.gv[:, :, a:e], L.maw[:, :, a:e], self.w)

    def _chosen(self, weight: torch.Tensor, size: int) -> torch.Tensor:
        """The variant's selection of entries with weight [B, Hq, n] at threshold beta /
        size (every entry at beta 0): bool [B, R, n], `topk_keep` or `union_keep`."""
        t = self.p.beta / size if self.p.beta > 0 else None
        if self.authors:
            return topk_keep(weight, t, self.p.head_groups, self.p.keep_min)
        return union_keep(weight, self.ctx.spec.n_kv_heads, t)

    def _select(self, L: LayerKV, k: torch.Tensor, v: torch.Tensor, maw: torch.Tensor,
                size: int, copied: Any) -> dict[str, float]:
        """Worker: KV_cpu += evicted entries; KV_ctx += those the variant selects at
        threshold beta / size. The clock starts once the D2H copy has landed (GPU audit
        finding 13): waiting for the side stream is not selection time."""
        import torch

        if copied is not None:
            copied.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            L.keep(k, v, self._chosen(maw, size), L.add_host(k, v))
        return {"select": time.perf_counter() - t0}

    def _reselect(self, L: LayerKV, qh: torch.Tensor, lse: torch.Tensor,
                  n: int) -> dict[str, float]:
        """Worker, after an append (lines 19-21): KV_ctx <- the KV_cpu[:n] entries the
        variant selects by their weight A_cpu (host softmax of the T appended queries qh
        [B, Hq, T, D] with lse [B, Hq, T], mean over the queries) at threshold beta / n."""
        import torch

        t0 = time.perf_counter()
        with torch.inference_mode():
            a_cpu = column_scores(qh, L.hk[:, :, :n], lse, scale=self.scale,
                                  q_start=n) / qh.shape[2]
            L.clear()
            L.keep(L.hk[:, :, :n], L.hv[:, :, :n], self._chosen(a_cpu, n), 0)
        return {"reselect": time.perf_counter() - t0}

    def _update_maw(self, L: LayerKV, q: torch.Tensor, lse: torch.Tensor, slot: int) -> None:
        """Line 8: MAW <- (1 - alpha) MAW + alpha A_gpu, A_gpu the window softmax [B, Hq, W].
        The entry just written at `slot` starts from 0 (`union-ema`) or, as in beyond-ae's
        add_cache, at its first weight A_gpu[slot] (`authors`). On the CPU one native call
        (probes/maw.c), else torch ops."""
        from kvbench.kernels import cpu

        if cpu.maw_ok(q, L.gk, lse, L.maw):
            cpu.maw_update(q, L.gk, lse, L.maw, scale=self.scale, alpha=self.p.alpha,
                           slot=slot if self.authors else -1)
            return
        a = decode_weights(q, L.gk, lse, scale=self.scale)
        L.maw.mul_(1 - self.p.alpha).add_(a, alpha=self.p.alpha)
        if self.authors:
            L.maw[:, :, slot] = a[:, :, slot]

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
        import torch

        with self.ctx.counters.fork("host"):
            self.ctx.counters.moved("d2h", q.numel() * q.element_size())
        qh = q.to(dtype=L.hk.dtype).to(self.ctx.host, non_blocking=True)
        if not q.is_cuda:
            return qh, None
        landed = torch.cuda.Event()
        landed.record(torch.cuda.current_stream())
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

    def _await_side(self, L: LayerKV) -> None:
        """The main stream waits for the layer's side-stream work (the previous step's MAW
        update and eviction copy) before it reads or writes the ring or its MAW (HGCA
        section 4: the streams are synchronised before each query)."""
        if L.side is None:
            return
        import torch

        torch.cuda.current_stream().wait_event(L.side)
        L.side = None

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

    # -- prefix cache (kvbench.prefix) ----------------------------------------------------------

    def export_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer KV_cpu (every evicted entry, oldest first) then the ring's resident
        entries, k/v [B, Hkv, n, D] on the accelerator in the model dtype."""
        import torch

        out = []
        for L in self.layers:
            self._join(L)
            self._await_side(L)
            parts = [(L.hk[:, :, :L.n_host], L.hv[:, :, :L.n_host])] + [
                (k, v) for k, v, _ in L.resident()]
            out.append(tuple(torch.cat([p[i].to(self.ctx.accel, self.ctx.dtype)
                                        for p in parts], dim=2) for i in (0, 1)))
        return out

    def import_kv(self, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Place n loaded tokens as a prefill of n places them (the ring keeps the latest
        whole blocks under W, the rest goes to KV_cpu) with every host entry in KV_ctx and
        a zero MAW: a saved request carries KV only (CXL KV-storage paper section 2). The
        append that follows attends all of KV_cpu and re-selects KV_ctx from its queries
        (Alg. 1 lines 19-21), and gives the window its MAW (line 8)."""
        import torch

        from kvbench.strategies._hgca_kv import host_dtype

        hd = host_dtype(self.ctx.dtype)
        for L, (k, v) in zip(self.layers, kv, strict=True):
            n = k.shape[2]
            evict = math.ceil((n - self.w + 1) / self.p.block) * self.p.block if n >= self.w \
                else 0
            r = n - evict
            L.gk[:, :, :r] = k[:, :, evict:]
            L.gv[:, :, :r] = v[:, :, evict:]
            L.maw[:, :, :r] = 0
            L.n, L.tail = r, 0
            if evict:
                self.ctx.counters.moved("d2h", 2 * k[:, :, :evict].numel() * k.element_size())
                hk, hv = (x[:, :, :evict].to("cpu", hd) for x in (k, v))
                every = torch.ones(k.shape[0], L.lens.numel() // k.shape[0], evict,
                                   dtype=torch.bool)
                L.keep(hk, hv, every, L.add_host(hk, hv))

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
