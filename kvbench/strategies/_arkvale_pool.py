"""ArkVale's parameters and the page pool of its sparse layers (Chen et al., "ArkVale",
NeurIPS 2024, sections 4-5): the pool on the accelerator, the host backup, the digests, and
the moves between them: a completed page's backup and digest, its entry into the pool, the
top set's placement and the recall of its missing pages from the backup.
kvbench.strategies.arkvale runs ArkVale's decode over them.

Layout per sparse layer: pool k/v [B, Hkv, C + 1, S, D] on the accelerator (slot C is the
current page), slot -> page ids [B, Hkv, C], digests [B, Hkv, ceil(max_len/S), D]; host
backup k/v page-major [P_max, B, Hkv, S, D], so that a backup of pages first.. and the
read of pages 0..nf-1 are one contiguous copy each, and one recall staging pair [B * Hkv *
C, S, D] shared by the layers: exactly sized and pinned when the accelerator is CUDA
(strategies._hostcopy; GPU audit findings 3 and 6). A recall gathers its pages on the host
into the staging (after the layer's last backup D2H has landed, and after the H2D that last
read the staging), then one async H2D and a scatter into the pool slots. The page ids to
recall must reach the host (the authors' `recall` reads them too): on CUDA a layer step
over the budget waits for its selection there; nothing else in a decode step syncs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbench.errors import require
from kvbench.strategies import Variant, check_variant, variant_field
from kvbench.strategies._hostcopy import HostKV, transfer
from kvbench.strategies._pages import Digests, check_pages, page_scores, select_pages

if TYPE_CHECKING:
    import torch

    from kvbench.runtime.context import RunContext


@dataclass(frozen=True)
class ArkValeParams:
    """ArkVale's variant, page size, accelerator page budget, top-k, sinks and window."""

    variant: str = variant_field(
        Variant("authors", "one page set per layer shared by every head, ranked by the mean "
                "score over all query heads (pku-liang/ArkVale's default, n_groups 1)"),
        Variant("per-kv-head", "one page set per KV head, ranked by its query heads' scores "
                "(ArkVale's n_groups = the KV heads; prefill still per layer)"))
    budget_tokens: int = field(default=4096, metadata={
        "help": "Accelerator page budget in tokens (whole pages, the current page included): "
                "all resident pages are attended; a budget covering the context is exact."})
    page_size: int = field(default=32, metadata={"help": "Tokens per page (S)."})
    pages: int = field(default=0, metadata={
        "help": "ArkVale's page_topks k: the sinks, the window and k - sinks - (window - 1) "
                "top pages are made resident each step, k + 1 pages in all (0: the paper's "
                "rule min(1280, budget / 2) / S, section 5.1)."})
    sinks: int = field(default=2, metadata={"help": "First pages always resident."})
    window_pages: int = field(default=2, metadata={
        "help": "Last pages always resident, the current page included."})
    dense_layers: int = field(default=2, metadata={
        "help": "Leading layers that keep every page (by real layer index)."})

    def __post_init__(self) -> None:
        check_variant(self)
        check_pages(self.page_size, self.budget_tokens, self.sinks, self.window_pages,
                    self.dense_layers)
        c = self.budget_tokens // self.page_size
        require(0 <= self.pages < max(c, 1), f"--pages {self.pages}: in [0, {c - 1}] "
                f"(below the budget's {c} pages, as ArkVale's page_topks)")
        require(self.pages == 0 or self.pages >= self.sinks + self.window_pages,
                f"--pages {self.pages}: fewer than --sinks + --window-pages")

    @property
    def topk(self) -> int:
        """k: full pages in the top set, the current page besides (the rule when --pages is
        0), at least sinks + window (ArkVale asserts it) and at most the pool's C."""
        c = self.budget_tokens // self.page_size - 1
        rule = min(1280, self.budget_tokens // 2) // self.page_size
        return min(self.pages or max(rule, self.sinks + self.window_pages), c)

    @property
    def prefill_sinks(self) -> int:
        """Sinks of the prefill's cut: at least 2 (`prefill_evict_extra_pages`), within the
        budget beside the window."""
        c = self.budget_tokens // self.page_size
        return min(max(2, self.sinks), c - self.window_pages)


class ArkValePool:
    """The pages of ArkVale's layers (a base class of ArkVale: its `p` the ArkValeParams and
    `ctx` the run): dense layers' k/v, sparse layers' pools, host backups, digests and slot
    -> page ids (module docstring), and the moves between them."""

    p: ArkValeParams
    ctx: RunContext

    @classmethod
    def slots(cls, params: ArkValeParams, max_len: int) -> int:
        """Pool slots for full pages besides the current page's: the budget's pages less
        one, at most the pages of the cache (a budget covering it allocates no more)."""
        return min(params.budget_tokens // params.page_size - 1, -(-max_len // params.page_size))

    def _init_pool(self, params: ArkValeParams, ctx: RunContext) -> None:
        """Allocate the pages (module docstring) for ctx's layers: the first
        `dense_layers` keep every token, [B, Hkv, max_len, D]."""
        import torch

        s, b, page = ctx.spec, ctx.batch, params.page_size
        hkv, d = s.n_kv_heads, s.head_dim
        self.c = self.slots(params, ctx.max_len)  # pool slots besides the current page
        p_max = -(-ctx.max_len // page)
        self.host = HostKV(ctx.accel.type == "cuda")
        self.k: dict[int, torch.Tensor] = {}  # dense layers: [B, Hkv, max_len, D]
        self.v: dict[int, torch.Tensor] = {}
        self.pool_k: dict[int, torch.Tensor] = {}  # [B, Hkv, C + 1, S, D]
        self.pool_v: dict[int, torch.Tensor] = {}
        self.host_k: dict[int, torch.Tensor] = {}  # [P_max, B, Hkv, S, D]
        self.host_v: dict[int, torch.Tensor] = {}
        self.slot_page: dict[int, torch.Tensor] = {}  # [B, Hkv, C], -1: empty
        self.dig: dict[int, Digests] = {}
        for i in range(ctx.n_layers):
            if i < params.dense_layers:
                self.k[i] = torch.empty(b, hkv, ctx.max_len, d, dtype=ctx.dtype,
                                        device=ctx.accel)
                self.v[i] = torch.empty_like(self.k[i])
                continue
            self.pool_k[i] = torch.empty(b, hkv, self.c + 1, page, d, dtype=ctx.dtype,
                                         device=ctx.accel)
            self.pool_v[i] = torch.empty_like(self.pool_k[i])
            self.host_k[i] = self.host.empty((p_max, b, hkv, page, d), ctx.dtype)
            self.host_v[i] = self.host.empty((p_max, b, hkv, page, d), ctx.dtype)
            self.slot_page[i] = torch.full((b, hkv, self.c), -1, dtype=torch.long,
                                           device=ctx.accel)
            self.dig[i] = Digests(b, hkv, ctx.max_len, d, page, "cuboid-mean", ctx.accel,
                                  ctx.dtype)
        self.length = [0] * ctx.n_layers  # tokens cached
        if self.host_k:
            self.stage = tuple(self.host.empty((b * hkv * self.c, page, d), ctx.dtype)
                               for _ in range(2))
        self.stored: dict[int, torch.cuda.Event] = {}  # layer -> its last backup's D2H
        self.staged: torch.cuda.Event | None = None  # the last recall's H2D out of stage

    def _split(self, n: int) -> tuple[int, int]:
        """(completed pages, tokens of the current page) of n cached tokens: the current
        page holds 1..S tokens once any is cached (ArkVale completes a page on the next)."""
        nf = max(n - 1, 0) // self.p.page_size
        return nf, n - nf * self.p.page_size

    # --- pages of one sparse layer ---------------------------------------------------

    def _enter(self, layer: int, page: int, cur_k: torch.Tensor, cur_v: torch.Tensor) -> float:
        """Completed page `page` (k/v [B, Hkv, 1, S, D], the current slot) into the pool: an
        empty slot while there is one (pages fill slots in order), else the slot of the page
        leaving the window, evicted (`_decode_alloc_1_page`, ArkVale's window ring). With one
        window page the completed page leaves it itself: it enters only if selected. Returns
        the pages evicted (rows x KV heads, or 0)."""
        import torch

        sp = self.slot_page[layer]
        leave = page - (self.p.window_pages - 1)
        evicted = 0.0
        if page < self.c:
            slot = sp.new_full(sp.shape[:2], page)
        elif leave < page:  # the window's oldest full page is resident (always in the top set)
            slot = (sp == leave).to(torch.int8).argmax(-1)  # [B, Hkv]
            evicted = float(slot.numel())
        else:
            return evicted
        bi = torch.arange(sp.shape[0], device=sp.device)[:, None]
        hi = torch.arange(sp.shape[1], device=sp.device)[None, :]
        self.pool_k[layer][bi, hi, slot] = cur_k[:, :, 0]
        self.pool_v[layer][bi, hi, slot] = cur_v[:, :, 0]
        sp[bi, hi, slot] = page
        return evicted

    def _place(self, layer: int, scores: torch.Tensor, target: torch.Tensor, fresh_first: int,
               fresh_k: torch.Tensor, fresh_v: torch.Tensor) -> None:
        """Make every target page resident (at most C): r = S[:K] - P is recalled into the
        slots of the lowest-scoring resident pages outside the target, e (Alg. 1 lines 5-6,
        11). Pages >= fresh_first were just written on the accelerator (fresh_k/v [B, Hkv,
        m, S, D]) and are copied on the device; older ones come from the host backup (h2d).
        Empty slots are taken first, in order, so a pool that is not full stays contiguous.
        """
        import torch

        sp = self.slot_page[layer]  # [B, Hkv, C]
        n_full = target.shape[2]
        valid = sp >= 0
        spc = sp.clamp_min(0)
        resident = torch.zeros(*sp.shape[:2], n_full + 1, dtype=torch.bool, device=sp.device)
        resident.scatter_(2, sp.masked_fill(~valid, n_full), True)  # empty: column n_full
        need = target & ~resident[:, :, :n_full]
        slot_score = torch.where(valid, scores.gather(2, spc), float("-inf"))
        keep = valid & target.gather(2, spc)
        order = slot_score.masked_fill(keep, float("inf")).argsort(dim=-1, stable=True)
        rank = need.cumsum(-1) - 1  # a row's i-th missing page takes its i-th slot in order
        counters = self.ctx.counters
        for old, first, last in ((True, 0, min(fresh_first, n_full)),
                                 (False, fresh_first, n_full)):
            if last <= first:
                continue
            b, h, pg = need[:, :, first:last].nonzero(as_tuple=True)  # CUDA: the one wait
            if not pg.numel():
                continue
            pg = pg + first
            slot = order[b, h, rank[b, h, pg]]
            counters.add("pages", "evicted", valid[b, h, slot].sum())
            if old:  # older pages: from the host backup
                self._recall(layer, b, h, pg, slot)
                self._count_recalled(pg.numel(), fresh_k.shape[-1])
            else:  # just written on the accelerator: copied there
                self.pool_k[layer][b, h, slot] = fresh_k[b, h, pg - first]
                self.pool_v[layer][b, h, slot] = fresh_v[b, h, pg - first]
            sp[b, h, slot] = pg

    def _recall(self, layer: int, b: torch.Tensor, h: torch.Tensor, page: torch.Tensor,
                slot: torch.Tensor) -> None:
        """Pages page[i] of (batch b[i], KV head h[i]) from the host backup into pool slots
        slot[i] (index tensors [m] on the accelerator): a host gather into the pinned
        staging, one async H2D each for k and v, a scatter on the accelerator."""
        import torch

        if self.staged is not None:
            self.staged.synchronize()  # the last recall's H2D has read the staging
        if layer in self.stored:
            self.stored.pop(layer).synchronize()  # the layer's backups have landed
        hk = self.host_k[layer]
        bsz, hkv = hk.shape[1], hk.shape[2]
        rows = ((page * bsz + b) * hkv + h).cpu()  # in [P_max * B * Hkv]: one D2H
        m = rows.numel()
        for host, stage, pool in ((hk, self.stage[0], self.pool_k[layer]),
                                  (self.host_v[layer], self.stage[1], self.pool_v[layer])):
            torch.index_select(host.view(-1, *host.shape[3:]), 0, rows, out=stage[:m])
            dev = torch.empty(stage[:m].shape, dtype=stage.dtype, device=pool.device)
            pool[b, h, slot] = transfer(dev, stage[:m])
        if pool.is_cuda:
            self.staged = torch.cuda.Event()
            self.staged.record(torch.cuda.current_stream())

    def _count_recalled(self, pages: int, d: int) -> None:
        """`pages` pages recalled from the host backup: their k and v ([S, d] each) over
        h2d, and the count (the torch path's `_place` and the native step's `decoded`)."""
        counters = self.ctx.counters
        counters.moved("h2d", 2.0 * pages * self.p.page_size * d * self.ctx.elem_bytes)
        counters.add("pages", "recalled", float(pages))

    def _complete(self, layer: int, first: int, k: torch.Tensor, v: torch.Tensor) -> float:
        """Back up full pages k/v [B, Hkv, m, S, D] (on the accelerator) to the host as pages
        first..first+m-1 (page-major: one contiguous D2H each, then an event for the host's
        gathers) and digest them (ArkVale's decode_backup_1_page, save_1_digest). Returns
        the bytes backed up, for counters.moved("d2h")."""
        import torch

        m = k.shape[2]
        transfer(self.host_k[layer][first:first + m], k.permute(2, 0, 1, 3, 4).contiguous())
        transfer(self.host_v[layer][first:first + m], v.permute(2, 0, 1, 3, 4).contiguous())
        if k.is_cuda:
            self.stored[layer] = torch.cuda.Event()
            self.stored[layer].record(torch.cuda.current_stream())
        self.dig[layer].put(first, k)
        return 2.0 * k.numel() * self.ctx.elem_bytes

    def _select(self, layer: int, q: torch.Tensor, n_full: int, k: int, sinks: int,
                per_layer: bool, append: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores [B, Hkv, n_full] of q [B, Hq, 1, D] (summed over each KV head's query
        heads, or over every head when `per_layer`: one set for the layer) and the target
        pages [B, Hkv, n_full] (bool): `sinks`, the window's full pages (the current page is
        the window's last, outside the pool), top of the rest; k in all, or every page when
        k >= n_full (`select_pages`; Alg. 1 line 2, S[:K]); `append`: q is the prompt's last
        query (the prefill's cut)."""
        dig = self.dig[layer]
        scores = page_scores(q, dig.lo[:, :, :n_full], dig.hi[:, :, :n_full], "kv", append)
        if per_layer:
            scores = scores.sum(1, keepdim=True).expand(scores.shape)
        self.ctx.counters.add("bytes_read", "accel", dig.nbytes(n_full * self.p.page_size))
        keep = select_pages(scores, n_full, k, sinks, self.p.window_pages - 1)
        return scores, scores.new_zeros(scores.shape).bool().scatter_(2, keep, True)

    def _all(self, layer: int, n_full: int) -> tuple[torch.Tensor, torch.Tensor]:
        """No selection (the pool holds every page): zero scores and every page targeted."""
        z = self.slot_page[layer].new_zeros(*self.slot_page[layer].shape[:2], n_full)
        return z.float(), z.bool().logical_not_()
