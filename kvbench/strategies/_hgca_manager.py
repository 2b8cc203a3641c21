"""HGCA's KV manager (HGCA paper section 3.2, Algorithm 1): per layer the accelerator's
ring of blocks and its moving average of attention weights (MAW), the host's KV_cpu and
contextual cache KV_ctx (strategies._hgca_kv.LayerKV), and the moves between them off the
critical path: the MAW update (line 8), the eviction of the oldest block (lines 10-13, a
side CUDA stream's D2H on a GPU), the host worker's selection into KV_ctx (lines 23-25) and
its re-evaluation after an append (lines 19-21). kvbench.strategies.hgca runs the hybrid
attention (Algorithm 2) over them; its module docstring says what each counter records.
The prefix cache (kvbench.prefix) moves a request's KV out of and into these stores
(`export_kv`, `import_kv`).

Lines 8-13 run off the critical path on CUDA: the MAW update and the eviction copy on the
side stream, the selection on the worker. On a CPU-only machine the accelerator role is
the calling thread, so it updates the MAW and copies the evicted block itself (cheap:
one [Hq, W] softmax and a block memcpy) and only the selection goes to the worker; a
second Python thread doing small tensor work beside the attention would only fight the
caller for the interpreter lock and the two cores. The worker's ops there run on its own
thread alone (kvbench.kernels.cpu.helper_thread: the paper's single host worker thread;
with two-thread OpenMP regions of its own it slowed the caller's every native call). Each
layer joins its worker jobs at its next step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvbench.strategies import Strategy, column_scores, decode_weights
from kvbench.strategies._hgca_kv import HgcaParams, LayerKV, host_dtype, topk_keep, union_keep
from kvbench.strategies._hostcopy import transfer

if TYPE_CHECKING:
    import torch

    from kvbench.runtime.context import RunContext


class HgcaManager(Strategy):
    """HGCA's per-layer ring, MAW and host caches, and Algorithm 1's moves between them."""

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

    def _await_side(self, L: LayerKV) -> None:
        """The main stream waits for the layer's side-stream work (the previous step's MAW
        update and eviction copy) before it reads or writes the ring or its MAW (HGCA
        section 4: the streams are synchronised before each query)."""
        if L.side is None:
            return
        import torch

        torch.cuda.current_stream().wait_event(L.side)
        L.side = None

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
