"""Page machinery shared by the page-sparse strategies (quest, arkvale, later scout, pnm).

KV is cut into pages of S tokens per (layer, sequence, KV head). Each full or partial page
has a key digest, a box [lo, hi] per channel that holds every key of the page:

- "minmax" (Quest Alg. 1, section 3.4): lo = channel-wise min, hi = channel-wise max.
- "cuboid-mean" (ArkVale section 5.2, the public code's default): centre c = (max+min)/2,
  radius r_i = mean over the page's keys of |k_i - c_i|; lo = c - r, hi = c + r. This box
  does not always hold every key, so its score is an estimate, not a bound.

A query's page score is sum_i max(q_i * hi_i, q_i * lo_i) (an upper bound on q.k for the
minmax box; Quest's `decode_attn.cuh`, ArkVale's `estimate.cu`); q after RoPE, no scale.

Top-k runs per KV head (the G query heads' scores summed, so the group shares one page
set: what a resident set needs) or per query head (Quest's accuracy code: `repeat_kv`
then per-head top-k); `topk_per` records which. Sink pages (the first `sinks`) and window
pages (the last `window`, the current partial page included) are always kept.

Shapes: keys k [B, Hkv, N, D]; digests lo/hi [B, Hkv, P, D] with P = ceil(N / S); scores
[B, H, P] with H = Hkv or Hq; selected page ids [B, H, K].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbench.errors import require
from kvbench.runtime.breakdown import Metric
from kvbench.timing import kernel

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from kvbench.runtime.context import Counters

DIGESTS = ("minmax", "cuboid-mean")
# counters.add("pages", "recalled"|"evicted", n) of a strategy with a resident page set:
# pages moved into or out of it, summed over batch rows and KV heads
PAGES = Metric("pages_{where}_per_step", "pages", "none", "step", of="pages",
               per="decode step: pages summed over layers, sequences and KV heads")
TOPK_PER = ("query", "kv")


def check_pages(page_size: int, budget_tokens: int, sinks: int, window: int,
                dense_layers: int, topk_per: str = "kv") -> None:
    """Validate the options every page strategy shares (one line, exit 2 when bad)."""
    require(page_size >= 1, f"--page-size {page_size}: must be at least 1")
    require(budget_tokens >= page_size, f"--budget-tokens {budget_tokens}: smaller than one "
            f"page of {page_size} tokens")
    require(sinks >= 0 and window >= 1, f"--sinks {sinks} / --window-pages {window}: sinks "
            ">= 0 and at least the current page (window >= 1)")
    require(sinks + window <= budget_tokens // page_size, f"--sinks {sinks} + --window-pages "
            f"{window} pages exceed the budget of {budget_tokens // page_size} pages")
    require(dense_layers >= 0, f"--dense-layers {dense_layers}: must be >= 0")
    require(topk_per in TOPK_PER, f"--topk-per '{topk_per}': one of {', '.join(TOPK_PER)}")


def check_layers(dense_layers: int, n_layers: int) -> None:
    """--dense-layers must leave the model's layers in range (checked once the model is known)."""
    require(dense_layers <= n_layers, f"--dense-layers {dense_layers}: the model runs "
            f"{n_layers} layers")


def digest(k: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Digest (lo, hi) [..., D] of the keys k [..., n, D] of one page (n >= 1), float32."""
    kf = k.float()
    hi, lo = kf.amax(dim=-2), kf.amin(dim=-2)
    if kind == "minmax":
        return lo, hi
    c = (hi + lo) * 0.5
    r = (kf - c.unsqueeze(-2)).abs().mean(dim=-2)
    return c - r, c + r


class Digests:
    """Per-layer page digests of one cache, kept up to date as keys are written.

    lo/hi [B, Hkv, P_max, D] in the cache's dtype on `device` (as Quest's metadata cache:
    2 / S of the keys' bytes more per page pair, i.e. KV bytes / S); `update(k, n0, n1)`
    re-digests every page touched by positions n0..n1-1 of the key buffer k [B, Hkv, >= n1,
    D]. Digests are computed in float32 and stored rounded like the keys they summarise.
    `alloc(shape)`, when given, makes the two buffers (pnm: on the device role's node).
    """

    def __init__(self, b: int, hkv: int, max_len: int, d: int, page: int, kind: str,
                 device: torch.device, dtype: torch.dtype,
                 alloc: Callable[[tuple[int, ...]], torch.Tensor] | None = None) -> None:
        import torch

        require(kind in DIGESTS, f"digest '{kind}': one of {', '.join(DIGESTS)}")
        self.page, self.kind = page, kind
        shape = (b, hkv, -(-max_len // page), d)
        if alloc is None:
            self.lo = torch.zeros(shape, dtype=dtype, device=device)
            self.hi = torch.zeros_like(self.lo)
        else:
            self.lo, self.hi = alloc(shape), alloc(shape)

    def nbytes(self, n: int) -> int:
        """Bytes of the digests of the pages covering n tokens (what one score pass reads)."""
        b, hkv, _, d = self.lo.shape
        return 2 * b * hkv * -(-n // self.page) * d * self.lo.element_size()

    def put(self, first: int, pages: torch.Tensor) -> None:
        """Digest whole pages [B, Hkv, m, S, D] as pages first..first+m-1."""
        m = pages.shape[2]
        self.lo[:, :, first:first + m], self.hi[:, :, first:first + m] = digest(
            pages, self.kind)

    def update(self, k: torch.Tensor, n0: int, n1: int) -> None:
        from kvbench.kernels import cpu

        if n1 - n0 == 1 and self.kind == "minmax" and cpu.digest_token(
                k, n0, self.lo, self.hi, self.page):  # a decode token: one native call
            return
        s = self.page
        first, last = n0 // s, -(-n1 // s)
        full_end = min(last, n1 // s)  # pages wholly below n1
        if full_end > first:  # whole pages in one batched call
            kk = k[:, :, first * s:full_end * s]
            self.put(first, kk.reshape(*kk.shape[:2], full_end - first, s, kk.shape[-1]))
        if full_end < last:  # the partial last page
            p = full_end
            self.lo[:, :, p], self.hi[:, :, p] = digest(k[:, :, p * s:n1], self.kind)


def page_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, per: str,
                append: bool = False) -> torch.Tensor:
    """Upper-bound scores of q [B, Hq, 1, D] against digests [B, Hkv, P, D]: [B, H, P].

    H = Hq (per="query") or Hkv (per="kv": the group's query heads summed). As
    max(q_i hi_i, q_i lo_i) = q_i+ hi_i + q_i- lo_i (lo <= hi), a score is two matmuls,
    q+ . hi + q- . lo, and the group's sum sums q+ and q- first: every head and page in a
    fixed number of calls, the digests read once. Counted as backend "torch-select" (a
    selection in torch ops; Quest's native one is "native-select"), so every record's
    method.backend says which selection path ran; `append`: q is a prompt's last query (its
    phase prefill/append, not decode).
    """
    import torch

    from kvbench.kernels.attention import note_backend

    note_backend("torch-select", q, append)
    b, hq, _, d = q.shape
    hkv, p = lo.shape[1], lo.shape[2]
    qf = q.float().reshape(b * hkv, hq // hkv, d)  # [B * Hkv, G, D]
    qp, qn = qf.clamp(min=0), qf.clamp(max=0)
    if per != "query":
        qp, qn = qp.sum(1, keepdim=True), qn.sum(1, keepdim=True)  # [B * Hkv, 1, D]
    hi_t = hi.float().reshape(b * hkv, p, d).transpose(1, 2)  # a view: B, Hkv merge
    lo_t = lo.float().reshape(b * hkv, p, d).transpose(1, 2)
    return torch.baddbmm(torch.bmm(qn, lo_t), qp, hi_t).view(b, -1, p)


def kept_pages(budget_tokens: int, page_size: int, n: int) -> int:
    """select_pages' K' over n cached tokens for a budget of whole pages: the budget's pages,
    or every page of a shorter context (known on the host, no device value read)."""
    return min(budget_tokens // page_size, -(-n // page_size))


def select_pages(scores: torch.Tensor, n_pages: int, k: int, sinks: int,
                 window: int) -> torch.Tensor:
    """Page ids [B, H, K'] to attend: sinks + window + top of the rest, K' = min(k, n_pages).

    scores [B, H, >= n_pages] (pages n_pages.. ignored); the window counts the last
    (possibly partial) page. Ids are sorted ascending.
    """
    import torch

    if k >= n_pages:
        return torch.arange(n_pages, device=scores.device).expand(*scores.shape[:2], -1)
    s = scores[:, :, :n_pages].clone()
    if sinks:
        s[:, :, :sinks].fill_(float("inf"))
    s[:, :, max(n_pages - window, 0):].fill_(float("inf"))
    return s.topk(k, dim=-1).indices.sort(dim=-1).values


def select_positions(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, n_pages: int,
                     k: int, sinks: int, window: int, per: str, page: int, n: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's selection (Quest sections 3.2-3.3) as token positions [B, H, k * page] and
    valid lengths [B, H] (`page_tokens`' layout) for q [B, Hq, 1, D] over the min/max
    digests lo/hi [B, Hkv, n_pages, D] of n tokens: one native call where
    `cpu.page_select_ok` (backend "native-select"), else `page_scores`, `select_pages` and
    `page_tokens` (three calls, "torch-select")."""
    from kvbench.kernels import cpu
    from kvbench.kernels.attention import note_backend

    if cpu.page_select_ok(q, lo, hi):
        note_backend("native-select", q)
        return cpu.page_select(q, lo, hi, n_pages, k, sinks, window, per, page, n)
    pages = select_pages(page_scores(q, lo, hi, per), n_pages, k, sinks, window)
    return page_tokens(pages, page, n)


def page_tokens(pages: torch.Tensor, page: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token positions [B, H, K * S] of page ids [B, H, K] and valid lengths [B, H].

    A row lists its whole pages (every position < n) in the order given, then the partial
    page n // S, then the pages past the end: positions at or past n (the partial page's
    empty tail, those pages) close the row as 0 and are excluded by the length, so a row's
    first `len` positions are < n. Ascending ids (select_pages') keep their order. The pages
    are ordered, not their K * S positions (a stable argsort over K; asking whether any
    position is invalid would read the device): a scout layer's two calls took 142 us each
    sorting 4 x 3 rows of 1024 positions (2-core AMD EPYC VM, 2026-11-27).
    """
    import torch

    full, part = divmod(n, page)  # pages below `full` are whole; page `full` holds `part`
    rank = (pages >= full).to(torch.int8) + (pages >= full + (part > 0)).to(torch.int8)
    ordered = pages.gather(-1, rank.argsort(dim=-1, stable=True))
    off = torch.arange(page, device=pages.device)
    pos = torch.add(off, ordered.unsqueeze(-1), alpha=page).flatten(-2)  # [B, H, K*S]
    invalid = pos >= n  # a suffix of each row
    return pos.masked_fill(invalid, 0), pos.shape[-1] - invalid.sum(-1)


def attend_selected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                    lens: torch.Tensor, counters: Counters, where: str = "accel"
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of decode queries q [B, Hq, 1, D] over selected keys of k/v [B, Hkv, N, D].

    pos [B, H, n] (first lens[b, h] valid) per KV head (H = Hkv: the group shares the
    selection) or per query head (H = Hq). Returns (out [B, Hq, 1, D], lse [B, Hq, 1]) and
    counts tokens (mean per head), FLOPs and the key/value bytes read from lens, summed at
    the step's end (no op or sync here). Every head in one call: on the CPU the native kernel
    (probes/attn.c, one selection per H row; backend "native-pages"), elsewhere one gather
    and the torch reference path (backend "torch-pages"); the record's method.backend says
    which ran.
    """
    from kvbench.kernels import cpu
    from kvbench.kernels.attention import note_backend

    hq, hkv, h = q.shape[1], k.shape[1], pos.shape[1]
    require(h % hkv == 0 and hq % h == 0, f"selection of {h} heads for {hq} query heads "
            f"over {hkv} KV heads")
    count_selected(q, lens, counters, where)
    if cpu.native_ok(q) and k.device.type == "cpu" and k.dtype == v.dtype == q.dtype:
        note_backend("native-pages", q)
        return _native_selected(q, k, v, pos, lens)
    note_backend("torch-pages", q)
    return _torch_selected(q, k, v, pos, lens)


def count_selected(q: torch.Tensor, lens: torch.Tensor, counters: Counters,
                   where: str = "accel") -> None:
    """The work of attending q [B, Hq, 1, D] over selections of lens [B, H] keys: tokens
    (mean per head), FLOPs and the key/value bytes, summed at the step's end (no op or sync
    here)."""
    hq, d, h = q.shape[1], q.shape[3], lens.shape[1]
    counters.add("tokens", where, lens, 1.0 / h)
    counters.add("flops", where, lens, 4.0 * hq * d / h)
    counters.add("bytes_read", where, lens, 2.0 * d * counters.elem_bytes)


@kernel
def _native_selected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                     lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """attend_selected on the native kernel: one call for every (sequence, H) row."""
    import torch

    from kvbench.kernels import cpu

    idx = pos if pos.dtype == torch.int32 else pos.to(torch.int32)  # native selection: as is
    return cpu.run(q, k, v, scale=q.shape[-1] ** -0.5, causal=False, q_start=0, idx=idx,
                   lens=lens, heads=pos.shape[1])


def _torch_selected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                    lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """attend_selected in torch: the selected rows gathered for every head at once (a KV
    head's keys serve its R = H / Hkv selections through a stride-0 view, not a copy), then
    the reference path (kvbench.kernels.attention.torch_attention). Padding slots are
    masked and their values zeroed (a NaN there must not reach the output)."""
    import torch

    from kvbench.kernels.attention import torch_attention

    b, h, n = pos.shape
    hkv, lk, d = k.shape[1], k.shape[2], k.shape[3]
    r = h // hkv
    idx = pos.reshape(b, hkv, r, n, 1).expand(b, hkv, r, n, d)
    kg = k.unsqueeze(2).expand(b, hkv, r, lk, d).gather(3, idx).view(b, h, n, d)
    vg = v.unsqueeze(2).expand(b, hkv, r, lk, d).gather(3, idx).view(b, h, n, d)
    hole = torch.arange(n, device=pos.device) >= lens.unsqueeze(-1)  # [B, H, n]
    vg.masked_fill_(hole.unsqueeze(-1), 0)
    return torch_attention(q, kg, vg, d ** -0.5, False, 0, key_pos=pos.masked_fill(hole, -1))
