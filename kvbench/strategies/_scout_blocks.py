"""ScoutAttention's parameters and the storage of its blocks (Zhang et al., "ScoutAttention",
DAC 2026, sections 3.2-3.4): where each block of a layer lives and how it moves: the
window's slide, a decode step's store to the host, the periodic recall (section 3.4) and its
copy host -> accelerator. kvbench.strategies.scout runs Algorithm 1 over them.

Layout per layer: host k/v token-major [max_len, B, Hkv, D] (sparse layers; a step's
store is one contiguous D2H, the native kernel reads the view [B, Hkv, n, D]) and one
recall staging pair [B * Hkv * min(C, blocks) * S, D] shared by the layers, exactly sized
and pinned on CUDA (strategies._hostcopy; GPU audit findings 3 and 6); accelerator k/v
[B, Hkv, max_len, D] indexed by position, valid only where resident (blocks leaving it are
set to NaN, so a stray read shows), digests [B, Hkv, ceil(max_len/S), D], resident mask
and last-selected step [B, Hkv, ceil(max_len/S)]. Host reads of stored KV (the worker,
--pred-error, a recall's gather) wait for the layer's last store event; a recall rewrites
the staging only after the H2D that last read it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbench.errors import require
from kvbench.paths import check_out
from kvbench.strategies._hostcopy import HostKV, tokens_first, transfer
from kvbench.strategies._pages import Digests, check_pages, page_scores

if TYPE_CHECKING:
    import torch

    from kvbench.runtime.context import RunContext

EVICT = ("score", "lru")


@dataclass(frozen=True)
class ScoutParams:
    """ScoutAttention's blocks, budget, resident set, recall and ablation switches."""

    budget_tokens: int = field(default=2048, metadata={
        "help": "Tokens attended per decode step and layer (whole blocks, the current one "
                "included), capped by the context; a budget covering it is exact."})
    page_size: int = field(default=32, metadata={
        "help": "Tokens per block (S); --block-size is the same option.",
        "aliases": ("block_size",)})
    resident_blocks: int = field(default=0, metadata={
        "help": "Full blocks resident on the accelerator per layer and KV head (0: budget / "
                "S, the top-k set after prefill)."})
    dense_layers: int = field(default=2, metadata={
        "help": "Leading layers with all KV on the accelerator (Quest's 2; 0: layer 0 runs "
                "its host part with the real query)."})
    sinks: int = field(default=0, metadata={"help": "First blocks always attended."})
    window_pages: int = field(default=1, metadata={
        "help": "Last blocks always attended and kept on the accelerator (the current one "
                "included)."})
    topk_per: str = field(default="kv", metadata={
        "help": "Top-k per 'kv' head group (one set per group) or per 'query' head."})
    precompute: bool = field(default=True, metadata={
        "help": "Layer-ahead host attention with the predicted query (off: the host part "
                "runs with the real query during the layer, Fig. 12 ablation)."})
    recall: bool = field(default=True, metadata={"help": "Periodic recall (section 3.4)."})
    recall_interval: int = field(default=8, metadata={
        "help": "Recall interval R in steps for every layer when no --recall-intervals file "
                "is given (the paper's mean is 8.7)."})
    recall_intervals: str = field(default="", metadata={
        "help": "Per-layer intervals R_l from a --calibrate-recall file."})
    recall_evict: str = field(default="score", metadata={
        "help": "Resident blocks a recall evicts: lowest 'score' under the real query, or "
                "'lru' (least recently selected)."})
    tau: float = field(default=0.12, metadata={
        "help": "CPU compute ratio threshold of the recall calibration, in (0, 1)."})
    calibrate_recall: str = field(default="", metadata={
        "help": "Run without recall and write per-layer intervals R_l for --tau to this file."})
    pred_error: bool = field(default=False, metadata={
        "help": "Also compute each predicted layer's output with the real query (its own "
                "selection, every selected block attended) and record the relative error "
                "and block overlap the predicted query adds, per layer (accuracy runs: a "
                "second attention per layer, inside the step's time)."})
    layer0: str = field(default="host part synchronous, real query", metadata={
        "derived": True, "help": "What a sparse layer without a layer ahead does."})
    accel_blocks: str = field(default="predicted & resident", metadata={
        "derived": True, "help": "Blocks the accelerator attends with the real query."})
    interval_mean: float = field(default=0.0, metadata={
        "derived": True, "help": "Mean R_l over sparse layers (0: no recall)."})

    def __post_init__(self) -> None:
        check_pages(self.page_size, self.budget_tokens, self.sinks, self.window_pages,
                    self.dense_layers, self.topk_per)
        require(self.resident_blocks >= 0,
                f"--resident-blocks {self.resident_blocks}: must be >= 0 (0: budget / S)")
        require(0 < self.tau < 1, f"--tau {self.tau}: must be in (0, 1)")
        require(self.recall_interval >= 1,
                f"--recall-interval {self.recall_interval}: must be at least 1")
        require(self.recall_evict in EVICT,
                f"--recall-evict '{self.recall_evict}': one of {', '.join(EVICT)}")
        require(not (self.calibrate_recall and self.recall_intervals),
                "--calibrate-recall writes intervals, --recall-intervals reads them: pass one")
        if self.calibrate_recall:  # before the run, not when it has ended
            check_out(self.calibrate_recall, "--calibrate-recall", parents=False)

    @property
    def resident(self) -> int:
        return self.resident_blocks or self.budget_tokens // self.page_size


class ScoutBlocks:
    """The block storage of Scout (a base class: its `p` the ScoutParams and `ctx` the run):
    per layer the accelerator's k/v by position, the host's token-major k/v, the digests, the
    resident set, the blocks below the window; the window's slide, a step's store, the
    periodic recall and its copy."""

    p: ScoutParams
    ctx: RunContext

    @staticmethod
    def recall_most(params: ScoutParams, max_len: int) -> int:
        """C' = min(C, blocks of the cache): the most blocks one recall copies per head."""
        return min(params.resident, -(-max_len // params.page_size))

    def _init_blocks(self, params: ScoutParams, ctx: RunContext) -> None:
        """Allocate the storage (module docstring) for ctx's layers; the first
        `dense_layers` keep only their accelerator k/v."""
        import torch

        L, s = ctx.n_layers, ctx.spec
        b, hkv, d, n = ctx.batch, s.n_kv_heads, s.head_dim, ctx.max_len
        pin = ctx.accel.type == "cuda"
        p_max = -(-n // params.page_size)
        self.acc_k = [torch.empty(b, hkv, n, d, dtype=ctx.dtype, device=ctx.accel)
                      for _ in range(L)]
        self.acc_v = [torch.empty_like(t) for t in self.acc_k]
        sparse = range(params.dense_layers, L)
        self.host = HostKV(pin)
        self.host_k = {i: self.host.empty((n, b, hkv, d), ctx.dtype) for i in sparse}
        self.host_v = {i: self.host.empty((n, b, hkv, d), ctx.dtype) for i in sparse}
        if sparse:
            rows = b * hkv * self.recall_most(params, n) * params.page_size
            self.stage = tuple(self.host.empty((rows, d), ctx.dtype) for _ in range(2))
        self.stored: dict[int, Any] = {}  # layer -> CUDA event of its last store's D2H
        self.staged: Any = None  # CUDA event: the last recall's H2D out of the staging
        self.dig = {i: Digests(b, hkv, n, d, params.page_size, "minmax", ctx.accel, ctx.dtype)
                    for i in sparse}
        self.res = {i: torch.zeros(b, hkv, p_max, dtype=torch.bool, device=ctx.accel)
                    for i in sparse}
        self.used = {i: torch.zeros(b, hkv, p_max, device=ctx.accel) for i in sparse}
        self.win = [0] * L  # blocks below the window (full, resident or host-only)
        self.stream = torch.cuda.Stream(ctx.accel) if pin else None
        self.recalling: dict[int, Any] = {}  # layer -> CUDA event of its recall copy

    # -- blocks: window, resident set, selection --------------------------------------------

    def _blocks(self, t: torch.Tensor, first: int, last: int) -> torch.Tensor:
        """Blocks first..last-1 of a k/v buffer t [B, Hkv, >= last * S, D] as a view
        [B, Hkv, last - first, S, D]."""
        s = self.p.page_size
        x = t[:, :, first * s:last * s]
        return x.view(x.shape[0], x.shape[1], last - first, s, x.shape[-1])

    def _evict(self, layer: int, mask: torch.Tensor, first: int = 0) -> None:
        """Blocks first.. where mask [B, Hkv, m] leave the accelerator: NaN there (the mask's
        blocks found once, a read of it on the host: prefill and recall steps)."""
        at = mask.nonzero(as_tuple=True)
        for t in (self.acc_k[layer], self.acc_v[layer]):
            self._blocks(t, first, first + mask.shape[2])[at] = float("nan")

    def _slide(self, layer: int, n_tot: int) -> None:
        """Blocks leaving the window at n_tot tokens stay resident while fewer than C are."""
        p = self.p
        ws = max(-(-n_tot // p.page_size) - p.window_pages, 0)
        for j in range(self.win[layer], ws):
            room = self.res[layer].sum(-1) < p.resident  # [B, Hkv]
            self.res[layer][:, :, j] = room
            gone = ~room[:, :, None, None, None]  # one block: filled through the mask, unread
            for t in (self.acc_k[layer], self.acc_v[layer]):
                self._blocks(t, j, j + 1).masked_fill_(gone, float("nan"))
        self.win[layer] = ws

    def _store(self, layer: int, n0: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [B, Hkv, T, D] to host rows n0..n0+T (one contiguous D2H each, then an event
        that host reads of them wait for)."""
        import torch

        transfer(self.host_k[layer][n0:n0 + k.shape[2]], tokens_first(k))
        transfer(self.host_v[layer][n0:n0 + k.shape[2]], tokens_first(v))
        self.ctx.counters.moved("d2h", 2.0 * k.numel() * self.ctx.elem_bytes)
        if k.is_cuda:
            self.stored[layer] = torch.cuda.Event()
            self.stored[layer].record(torch.cuda.current_stream())

    def _landed(self, layer: int) -> None:
        """This thread waits for the layer's stores to reach the host."""
        if layer in self.stored:
            self.stored[layer].synchronize()

    def _recall(self, layer: int, q: torch.Tensor) -> None:
        """Section 3.4: make the top C full blocks below the window (by the real query q's
        digest scores, per KV head) resident; evict by `--recall-evict`."""
        import torch

        p, c = self.p, self.ctx.counters
        ws = self.win[layer]
        if not ws:
            return
        with c.timed("bookkeeping.recall"):
            dig, res = self.dig[layer], self.res[layer][:, :, :ws]
            scores = page_scores(q, dig.lo[:, :, :ws], dig.hi[:, :, :ws], "kv")
            top = scores.topk(min(p.resident, ws), dim=-1).indices
            target = torch.zeros_like(res).scatter_(2, top, True)
            missing = target & ~res
            need = (missing.sum(-1) - (p.resident - self.res[layer].sum(-1))).clamp_min(0)
            cand = res & ~target
            key = scores if p.recall_evict == "score" else self.used[layer][:, :, :ws]
            rank = key.masked_fill(~cand, float("inf")).argsort(-1).argsort(-1)
            evict = cand & (rank < need[..., None])
            c.add("pages", "recalled", missing)  # summed at the step's end: no sync
            c.add("pages", "evicted", evict)
            self.res[layer][:, :, :ws] = (res & ~evict) | missing
            self._evict(layer, evict)
            # the blocks the host gathers, read on the host (host_reads)
            b, h, j = missing.to(self.ctx.host).nonzero(as_tuple=True)
            if not j.numel():
                return
            c.moved("h2d.recall", 2.0 * j.numel() * p.page_size * q.shape[-1]
                    * self.ctx.elem_bytes)
            self._copy_blocks(layer, ws, b, h, j)

    def _copy_blocks(self, layer: int, ws: int, b: torch.Tensor, h: torch.Tensor,
                     j: torch.Tensor) -> None:
        """Blocks j[i] of (batch b[i], KV head h[i]) (index tensors [m] on the host), from
        the host into the accelerator k/v: gathered on the host into the pinned staging
        [m * S, D], one H2D each for k and v and a scatter, on the side stream on CUDA
        (waited for at this layer's next step)."""
        import torch

        s = self.p.page_size
        if self.staged is not None:
            self.staged.synchronize()  # the last recall's H2D has read the staging
        self._landed(layer)
        hk = self.host_k[layer]
        bsz, hkv, d = hk.shape[1], hk.shape[2], hk.shape[3]
        tok = (j[:, None] * s + torch.arange(s)).flatten()  # [m * S] positions
        rows = (tok * bsz + b.repeat_interleave(s)) * hkv + h.repeat_interleave(s)
        m = rows.numel()
        at = tuple(t.to(self.acc_k[layer].device, non_blocking=True) for t in (b, h, j))
        side = self.stream is not None
        if side:
            self.stream.wait_stream(torch.cuda.current_stream())
        for src, stage, dst in ((hk, self.stage[0], self.acc_k[layer]),
                                (self.host_v[layer], self.stage[1], self.acc_v[layer])):
            torch.index_select(src.view(-1, d), 0, rows, out=stage[:m])
            with torch.cuda.stream(self.stream) if side else contextlib.nullcontext():
                dev = transfer(torch.empty(m, d, dtype=dst.dtype, device=dst.device),
                               stage[:m])
                self._blocks(dst, 0, ws)[at] = dev.view(-1, s, d)
        if side:
            for t in at:  # freed by the main stream only after the copy
                t.record_stream(self.stream)
            self.staged = self.recalling[layer] = torch.cuda.Event()
            self.staged.record(self.stream)
