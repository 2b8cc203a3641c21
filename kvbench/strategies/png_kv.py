"""PnG-KV: PNM-KV plus GPU attention over a steady set of pages, merged by log-sum-exp.

CXL-PNM (arXiv 2511.00321) section 3.3, Fig. 6(c), Algorithm 1 lines 7-11, Fig. 9; spec
sheet section 5. The device role does what PNM-KV does (kvbench.strategies.pnm_kv): it
holds every page, digests, scores and picks the budget set S[:T_Budget] each step. The
accelerator keeps, for every sequence of the batch and every KV head, a pool P of
T_Steady / S page slots (`--steady-tokens`, or `--steady-ratio` of the budget, default
#GPU / (#GPU + #PNM) = 1 / (1 + `--devices`), section 4.1, the likely reading of "steady
ratio"), updated by Steady-Select:

    e <- P - S[:T_Budget]            line 8: resident pages no longer in the budget set
    r <- (S[:T_Budget] - P)[:|e|]    line 9 with the slice the comment and Fig. 9 mean:
                                     the |e| best budget pages not resident, in score order
    P[e] <- r                        line 11: recalled into the freed slots (empty slots
                                     count as free; a freed slot with no page stays empty)

S is the device's ranking (sinks and window first, then by score); only full pages can be
steady (the current page changes every step and stays on the device). Then the
accelerator attends its resident pages and the device attends the rest of the budget set,
and the two partial results are merged exactly by log-sum-exp (FlashAttention style, as
the paper merges before the FC layers): the attended set is the budget set, so the output
equals PNM-KV's; only where the work runs, and the recalls, differ. Every page entering P
is a recall from CXL memory (the accelerator keeps no copy of the pages it produced),
counted per step and layer ("pages", "recalled"/"evicted", summed over sequences and KV
heads, bytes on "h2d"), with the device's lse returned beside its output. In the stage
graph the device's attention is a fork ("pnm") beside the accelerator's steady attention,
which run concurrently (section 3.3); the layer's output waits for both.

Fidelity (Algorithm 1 lines 7-11 line by line): docs/fidelity/png-kv.md.

Exact setting: a budget covering the context. Layout per sparse layer: pool k/v [B, Hkv,
C, S, D] and slot -> page ids [B, Hkv, C] (-1: empty) on the accelerator, C = T_Steady / S.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbench.errors import require
from kvbench.strategies import STRATEGIES
from kvbench.strategies._pages import PAGES, attend_selected, kept_pages
from kvbench.strategies._pnm import DeviceKV, PnmParams, mask_tokens, resolve_node
from kvbench.strategies.pnm_kv import PnmKV

if TYPE_CHECKING:
    import torch

    from kvbench.runtime.context import RunContext


@dataclass(frozen=True)
class PngParams(PnmParams):
    """PNM-KV's parameters and the accelerator's steady set."""

    steady_tokens: int = field(default=0, metadata={
        "help": "T_Steady: tokens per sequence and KV head the accelerator attends (whole "
                "pages; 0: --steady-ratio of the budget); the run records the value used."})
    steady_ratio: float = field(default=0.0, metadata={
        "help": "T_Steady / T_Budget when --steady-tokens is 0 (0: #GPU / (#GPU + #PNM) = "
                "1 / (1 + --devices), section 4.1)."})

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.steady_ratio <= 1, f"--steady-ratio {self.steady_ratio}: must be "
                "in [0, 1]")
        require(0 <= self.steady_tokens <= self.budget_tokens, f"--steady-tokens "
                f"{self.steady_tokens}: must be in [0, --budget-tokens {self.budget_tokens}]")

    def steady(self) -> int:
        """T_Steady in tokens: the given count, else the ratio of the budget."""
        ratio = self.steady_ratio or 1 / (1 + self.devices)
        return self.steady_tokens or int(ratio * self.budget_tokens)


@STRATEGIES.register
class PngKV(PnmKV):
    """PnG-KV: PNM-KV plus accelerator attention over Alg. 1's steady pages, lse-merged."""

    name = "png-kv"
    version = "1"
    params = PngParams
    exact = (("budget_tokens", 1 << 20),)  # every page selected
    sparse = (("budget_tokens", 32), ("page_size", 8), ("sinks", 1), ("window_pages", 1))
    host_reads = (1, "the steady pages to recall into the GPU pool (one nonzero per sparse "
                  "layer, as ArkVale's recall)")
    metrics = (*PnmKV.metrics, PAGES)

    @classmethod
    def for_run(cls, params: PngParams, max_len: int) -> tuple[PngParams, list[str]]:
        p, notes = resolve_node(params)
        return dataclasses.replace(p, steady_tokens=p.steady()), notes

    @classmethod
    def slots(cls, params: PngParams, max_len: int) -> int:
        """Pool slots C per sequence and KV head (no more than the context's pages)."""
        return min(params.steady(), max_len) // params.page_size

    @classmethod
    def accel_bytes(cls, params: PngParams, ctx: RunContext) -> int:
        s = ctx.spec
        sparse = max(ctx.n_layers - params.dense_layers, 0)
        return (2 * sparse * ctx.batch * s.n_kv_heads * cls.slots(params, ctx.max_len)
                * params.page_size * s.head_dim * ctx.elem_bytes)

    def __init__(self, params: PngParams, ctx: RunContext) -> None:
        import torch

        super().__init__(params, ctx)
        s, b = ctx.spec, ctx.batch
        self.c = self.slots(params, ctx.max_len)
        shape = (b, s.n_kv_heads, self.c, params.page_size, s.head_dim)
        sparse = range(params.dense_layers, ctx.n_layers)
        self.pool_k = {i: torch.empty(shape, dtype=ctx.dtype, device=ctx.accel) for i in sparse}
        self.pool_v = {i: torch.empty_like(t) for i, t in self.pool_k.items()}
        self.slot_page = {i: torch.full(shape[:3], -1, dtype=torch.long, device=ctx.accel)
                          for i in sparse}

    def steady_select(self, layer: int, mask: torch.Tensor, ranked: torch.Tensor,
                      nf: int) -> torch.Tensor:
        """Alg. 1 lines 7-11 over the nf full pages: update the pool from the budget mask
        [B, Hkv, >= nf] and ranking [B, Hkv, >= nf]; returns resident [B, Hkv, nf]."""
        import torch

        sp = self.slot_page[layer]  # [B, H, C]
        dev = ranked.device
        inb, rank = mask[:, :, :nf].to(sp.device), ranked[:, :, :nf].to(sp.device)
        valid = sp >= 0
        spc = sp.clamp_min(0)
        resident = torch.zeros(*sp.shape[:2], nf + 1, dtype=torch.bool, device=sp.device)
        resident.scatter_(2, sp.masked_fill(~valid, nf), True)
        ev = ~(valid & inb.gather(2, spc))  # line 8 (and the empty slots)
        order = rank.argsort(dim=-1, descending=True, stable=True)  # S
        cand = (inb & ~resident[:, :, :nf]).gather(2, order)  # S[:T_Budget] - P, in order
        crank = cand.cumsum(-1) - 1
        take = cand & (crank < ev.sum(-1, keepdim=True))  # line 9: [:|e|]
        b, h, i = take.nonzero(as_tuple=True)
        pg = order[b, h, i]
        slot = (~ev).to(torch.int8).argsort(dim=-1, stable=True)[b, h, crank[b, h, i]]
        counters = self.ctx.counters
        counters.add("pages", "evicted", valid & ev)  # summed at the step's end: no sync
        counters.add("pages", "recalled", float(pg.numel()))
        sp.masked_fill_(ev, -1)
        if pg.numel():  # line 11: recall the pages from the device's memory
            size, d = self.p.page_size, self.dev.d
            hb, hh, hp = b.to(dev), h.to(dev), pg.to(dev)
            src_k = self.dev.k[layer][:, :, :nf * size].unflatten(2, (nf, size))
            src_v = self.dev.v[layer][:, :, :nf * size].unflatten(2, (nf, size))
            self.pool_k[layer][b, h, slot] = src_k[hb, hh, hp].to(sp.device)
            self.pool_v[layer][b, h, slot] = src_v[hb, hh, hp].to(sp.device)
            sp[b, h, slot] = pg
            counters.moved("h2d", 2.0 * pg.numel() * size * d * self.ctx.elem_bytes)
        resident.zero_()
        resident.scatter_(2, sp.masked_fill(sp < 0, nf), True)
        return resident[:, :, :nf]

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """One token: the device selects the budget set, the pool takes its steady pages,
        the accelerator attends them and the device the rest; merged by lse."""
        import torch

        from kvbench.kernels.attention import merge

        n, got = self._budget(layer, q, k, v, DeviceKV.select)
        mask, ranked = got or (None, None)
        size, most = self.p.page_size, kept_pages(self.p.budget_tokens, self.p.page_size, n)
        if mask is None or self.c == 0 or n < size:  # no full page can be steady yet
            sel = None if mask is None else mask_tokens(mask, size, n, most)
            self.last[layer] = sel
            out = self._device_attention(layer, q, sel, n)[0]
            self.dev.activations_back(q.shape[0], lse=False)
            return out.to(q.device)
        self.last[layer] = mask_tokens(mask, size, n, most)
        nf = n // size
        counters = self.ctx.counters
        with counters.timed("bookkeeping.steady_select"):
            resident = self.steady_select(layer, mask, ranked, nf)
        rest = mask.clone()
        rest[:, :, :nf] &= ~resident.to(mask.device)
        with counters.fork("pnm"):  # the device attends beside the GPU's steady pages
            o2, s2 = self._device_attention(layer, q, mask_tokens(rest, size, n, most), n)
            self.dev.activations_back(q.shape[0], lse=True)
        sp = self.slot_page[layer]
        b, h, c, d = sp.shape[0], sp.shape[1], self.c, self.dev.d
        order = (sp < 0).to(torch.int8).argsort(dim=-1, stable=True)  # resident slots first
        off = torch.arange(size, device=sp.device)
        pos = (order[..., None] * size + off).flatten(2)  # [B, H, C * S]
        lens = (sp >= 0).sum(-1) * size
        o1, s1 = attend_selected(q, self.pool_k[layer].view(b, h, c * size, d),
                                 self.pool_v[layer].view(b, h, c * size, d), pos, lens,
                                 counters, where="accel")
        return merge(o1, s1, o2, s2)[0]
