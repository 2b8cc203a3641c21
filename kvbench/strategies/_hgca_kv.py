"""HGCA's parameters and per-layer KV state (HGCA paper section 3.2, Algorithm 1), used by
strategies.hgca.

The accelerator holds a ring of fixed-size blocks, k/v [B, Hkv, W, D], with a moving
average of attention weights (MAW) per resident entry and query head, [B, Hq, W]. The
host holds KV_cpu (every evicted entry, k/v [B, Hkv, N, D]) and the contextual cache
KV_ctx: per row R its selected entries, in position order. R is Hq for the `authors`
variant (each query head its own selection, `topk_keep`) and Hkv for `union-ema` (a KV
head's query heads share the union of their selections, `union_keep`). KV_ctx is stored
per KV head: a contiguous copy of the union of its rows' selections (k/v [B, Hkv, N, D],
`ulens` entries each), for `authors` which of them each query head attends (`ckeep`
[B, Hq, N] bool), and per row its entries' positions in KV_cpu (`cpos` [B * R, N] int32,
`lens` entries). The host's sparse attention streams each copy once for the KV head's
query group, each head skipping the entries it did not select. The artifact
copies each head's selection into a KV_ctx of its own: under GQA (which it does not run)
that is G copies of a KV head's entries, read G times from memory; gathering the rows
from KV_cpu instead reads at the density of the selection, and at HGCA's 30-40% a
hardware prefetcher pulls nearly every line (as much as dense attention over KV_cpu).
Only the CPU reads KV_cpu and KV_ctx (native kernel, gathers), so they are pageable; the
eviction staging that the side stream's D2H writes is exactly sized and pinned on CUDA
(strategies._hostcopy, GPU audit finding 3).
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from kvbench.errors import require
from kvbench.kernels.cpu import default_threads
from kvbench.strategies import Variant, _budget, check_variant, variant_field
from kvbench.strategies._hostcopy import HostKV

if TYPE_CHECKING:
    import torch

    from kvbench.runtime.context import RunContext

_SCORES = 1 << 24  # fp32 attention scores per chunk of ingest_maw (64 MiB)
BLOCK = 64  # the largest automatic block (tokens)
MIN_BLOCKS = 4  # a window of fewer blocks is outside the paper's regime (a ring of blocks)


@dataclass(frozen=True)
class HgcaParams:
    """HGCA knobs (section 3.2): GPU window, sparsification, moving average, blocks, threads."""

    variant: str = variant_field(
        Variant("authors", "deng451e/beyond-ae KVcache_manager.py: prefill entries scored by "
                "the column mean of the causal prefill attention (threshold beta / P), a new "
                "entry's MAW starts at its first weight, per query head its top-k host "
                "entries (k: the largest at-threshold count in its group of adjacent heads, "
                "at least --keep-min)"),
        Variant("union-ema", "kvbench's earlier rules: prefill scored by replaying the "
                "decode moving average over the prompt (threshold beta / W), a new entry's "
                "MAW starts at 0, a KV head keeps the host entries any of its query heads "
                "rates above the threshold and all of them attend those",
                ignores=("keep_min", "head_groups")))
    gpu_share: float = _budget.gpu_share(0.25, "; the window, rounded down to whole blocks")
    gpu_tokens: int = _budget.gpu_tokens("; a multiple of --block")
    beta: float = field(default=1.0, metadata={
        "help": "Sparsification factor: host entries with MAW > beta / window are attended "
                "(0: all)."})
    alpha: float = field(default=0.003, metadata={
        "help": "Moving-average factor of attention weights, in (0, 1] (not given in the "
                "paper; 0.003 was best of 0.001-0.1 on held-out text, results/hgca-table1)."})
    block: int = field(default=0, metadata={
        "help": f"KV block size in tokens (0: the largest power of two up to {BLOCK} that "
                f"leaves the window at least {MIN_BLOCKS} blocks)."})
    keep_min: int = field(default=10, metadata={
        "help": "authors: the fewest host entries a query head keeps of each selection "
                "(the artifact's keep_min, 10; at most the entries offered)."})
    head_groups: int = field(default=4, metadata={
        "help": "authors: query heads are split into groups of Hq // this many adjacent "
                "heads, whose heads all keep as many entries as the group's most (the "
                "artifact's head_split_num, 4)."})
    cpu_threads: int = field(default=0, metadata={
        "help": "Threads of the host sparse attention (0: this process's CPUs, less one "
                "where CUDA is present, for the thread that launches the GPU work; the run "
                "records the number)."})

    window_blocks: int = field(default=0, metadata={
        "derived": True, "help": "Blocks in the accelerator window (set by the run)."})

    def __post_init__(self) -> None:
        check_variant(self)
        require(self.beta >= 0, f"--beta {self.beta}: must be >= 0")
        _budget.check(self.gpu_share, self.gpu_tokens)
        require(0 < self.alpha <= 1, f"--alpha {self.alpha}: must be in (0, 1]")
        require(self.block >= 0, f"--block {self.block}: must be at least 1 (0: automatic)")
        require(self.keep_min >= 0, f"--keep-min {self.keep_min}: must be >= 0")
        require(self.head_groups >= 1, f"--head-groups {self.head_groups}: must be >= 1")
        require(self.cpu_threads >= 0,
                f"--cpu-threads {self.cpu_threads}: must be >= 0 (0: automatic)")

    def tokens(self, max_len: int) -> int:
        """Accelerator window W in tokens for a cache of max_len, unchecked (block resolved
        by `Hgca.for_run`)."""
        if self.gpu_tokens:
            return self.gpu_tokens
        w = int(self.gpu_share * max_len) // self.block * self.block
        return max(w, self.block) if max_len <= self.block else w  # one block: never evicted

    def window(self, max_len: int) -> int:
        """`tokens(max_len)`, or a KvbenchError when it is not a usable ring of blocks."""
        require(self.gpu_tokens % self.block == 0, f"--block {self.block} does not divide "
                f"the GPU window of {self.gpu_tokens} tokens")
        w = self.tokens(max_len)
        require(w >= self.block, f"GPU share leaves no room for the prompt: a window of "
                f"{w} tokens of {max_len} is less than one block of {self.block}")
        return w


def host_threads(cuda: bool) -> int:
    """The automatic --cpu-threads: this process's CPUs, less one on a CUDA run (GPU audit
    finding 18: every core busy in the host part stalls the thread launching GPU work)."""
    n = default_threads()
    return max(1, n - 1) if cuda else n


def host_dtype(dtype: torch.dtype) -> torch.dtype:
    """The host copies' dtype: what the native kernel reads (float16 becomes float32)."""
    import torch

    return dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32


class CtxSizes(NamedTuple):
    """KV_ctx's sizes as Python numbers, measured where KV_ctx changes (the worker's
    selection, an import), so that a decode step reads no tensor for them."""

    longest: int  # entries in the longest KV-head copy
    mean: float  # entries per row, the mean
    copied: int  # entries in all the copies
    per_row: tuple[int, ...]  # entries of row h of every sequence, summed over the batch


class LayerKV:
    """One layer: ring + MAW on the accelerator, KV_cpu and KV_ctx on the host, worker jobs."""

    def __init__(self, ctx: RunContext, w: int, block: int, rows: int) -> None:
        """rows: KV_ctx rows per sequence (Hq or Hkv, see the module docstring)."""
        import torch

        s, b, n = ctx.spec, ctx.batch, ctx.max_len
        hkv, hq, d = s.n_kv_heads, s.n_heads, s.head_dim
        hd = host_dtype(ctx.dtype)
        self.host = HostKV(ctx.accel.type == "cuda")  # DMA staging, pinned on CUDA
        self.w = w
        self.gk = torch.empty(b, hkv, w, d, dtype=ctx.dtype, device=ctx.accel)
        self.gv = torch.empty_like(self.gk)
        self.maw = torch.zeros(b, hq, w, dtype=torch.float32, device=ctx.accel)
        self.n = 0  # resident entries
        self.tail = 0  # slot of the oldest resident entry (block aligned)
        self.hk = torch.empty(b, hkv, n, d, dtype=hd)  # KV_cpu
        self.hv = torch.empty_like(self.hk)
        self.n_host = 0
        self.ck = torch.empty(b, hkv, n, d, dtype=hd)  # KV_ctx: per KV head, its rows' union
        self.cv = torch.empty_like(self.ck)
        self.ulens = torch.zeros(b * hkv, dtype=torch.int32)
        # authors: query head h attends copy entry u where ckeep[b, h, u]
        self.ckeep = torch.zeros(b, hq, n, dtype=torch.bool) if rows != hkv else None
        self.lens = torch.zeros(b * rows, dtype=torch.int32)
        self.cpos = torch.empty(b * rows, n, dtype=torch.int32)  # row r's entries in KV_cpu
        self.sizes = CtxSizes(0, 0.0, 0, (0,) * rows)
        self.seen = (0, 0)  # (host entries, resident entries) the last decode step attended
        self.sk = self.host.empty((b, hkv, block, d), hd)  # eviction staging
        self.sv = self.host.empty((b, hkv, block, d), hd)
        self.smaw = self.host.empty((b, hq, block), torch.float32)
        self.out: torch.Tensor | None = None  # host part's output buffers [B, Hq, 1, D]
        self.lse: torch.Tensor | None = None
        self.merged: Any = None  # CUDA event: the merge that read out/lse is done
        self.jobs: list[Future[dict[str, float]]] = []  # worker jobs, in submission order
        self.copied: Any = None  # CUDA event: the staging copy is complete
        self.side: Any = None  # CUDA event: the side stream's last MAW update / copy is done

    @staticmethod
    def pinned(ctx: RunContext, block: int) -> int:
        """Host bytes one layer page-locks on CUDA: eviction staging k/v [B, Hkv, block, D]
        and MAW [B, Hq, block] (HostKV, exact), output [B, Hq, 1, D] and lse [B, Hq, 1]
        (kernels.cpu.output_buffers); 0 on other accelerators."""
        if ctx.accel.type != "cuda":
            return 0
        s, b = ctx.spec, ctx.batch
        he = host_dtype(ctx.dtype).itemsize
        return b * (2 * s.n_kv_heads * block * s.head_dim * he
                    + s.n_heads * (block * 4 + s.head_dim * he + 4))

    @staticmethod
    def nbytes(ctx: RunContext, w: int, block: int, rows: int) -> tuple[int, int]:
        """(accelerator, host) bytes one layer allocates (the output buffers included)."""
        s, b = ctx.spec, ctx.batch
        hkv, hq, d = s.n_kv_heads, s.n_heads, s.head_dim
        he = host_dtype(ctx.dtype).itemsize
        accel = b * w * (2 * hkv * d * ctx.elem_bytes + hq * 4)  # ring k/v, MAW
        host = b * hkv * d * he * (2 * ctx.max_len + 2 * block)  # KV_cpu, staging
        host += b * hkv * (2 * d * he * ctx.max_len + 4)  # KV_ctx's copies and lengths
        host += b * rows * (4 * ctx.max_len + 4)  # its rows' positions and lengths
        host += b * hq * ctx.max_len if rows != hkv else 0  # ckeep
        host += b * hq * (block * 4 + d * he + 4)  # staging MAW, output and lse
        return accel, host

    def resident(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """The resident slots as one or two (k, v, maw) ranges, oldest first."""
        a, e = self.tail, self.tail + self.n
        if e <= self.w:
            return ((self.gk[:, :, a:e], self.gv[:, :, a:e], self.maw[:, :, a:e]),)
        e -= self.w
        return ((self.gk[:, :, a:], self.gv[:, :, a:], self.maw[:, :, a:]),
                (self.gk[:, :, :e], self.gv[:, :, :e], self.maw[:, :, :e]))

    def add_host(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """KV_cpu += k/v [B, Hkv, n, D] (Alg. 1 line 25); returns the first one's position."""
        h0, n = self.n_host, k.shape[2]
        self.hk[:, :, h0:h0 + n] = k
        self.hv[:, :, h0:h0 + n] = v
        self.n_host += n
        return h0

    def clear(self) -> None:
        """Empty KV_ctx (a re-selection rebuilds it)."""
        self.lens.zero_()
        self.ulens.zero_()
        if self.ckeep is not None:
            self.ckeep.zero_()
        self.sizes = CtxSizes(0, 0.0, 0, (0,) * len(self.sizes.per_row))

    def keep(self, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, first: int) -> None:
        """KV_ctx[row] += the entries of k/v [B, Hkv, n, D] (KV_cpu positions first,
        first + 1, ...) that keep [B, R, n] (bool, from `topk_keep` or `union_keep`) marks
        for the row, in position order; a row of query head h reads KV head h // (R / Hkv).
        The KV head's copy takes the union of its rows' new entries."""
        import torch

        b, hkv, n, d = k.shape
        r = keep.shape[1]
        union = keep.view(b, hkv, r // hkv, n).any(dim=2).view(b * hkv, n)
        slot = self.ulens.long()[:, None] + union.long().cumsum(dim=1) - 1  # [B * Hkv, n]
        urows, uj = union.nonzero(as_tuple=True)
        for dst, x in ((self.ck, k), (self.cv, v)):
            dst.view(b * hkv, -1, d)[urows, slot[urows, uj]] = x.reshape(b * hkv, n, d)[urows, uj]
        keep = keep.reshape(b * r, n)
        rows, j = keep.nonzero(as_tuple=True)
        if self.ckeep is not None:  # row b * Hq + h: copy row b * Hkv + h // G
            src = rows // r * hkv + rows % r // (r // hkv)
            self.ckeep.view(b * r, -1)[rows, slot[src, j]] = True
        pos = self.lens.long()[rows] + (keep.long().cumsum(dim=1) - 1)[rows, j]
        self.cpos[rows, pos] = (first + j).to(torch.int32)
        self.lens += keep.sum(dim=1, dtype=torch.int32)
        self.ulens += union.sum(dim=1, dtype=torch.int32)
        got = torch.cat([self.lens.view(b, r).sum(dim=0), torch.stack(
            [self.ulens.max().long(), self.lens.sum(), self.ulens.sum()])]).tolist()
        self.sizes = CtxSizes(got[r], got[r + 1] / (b * r), got[r + 2], tuple(got[:r]))


def union_keep(weight: torch.Tensor, hkv: int, threshold: float | None) -> torch.Tensor:
    """`union-ema` (HGCA Alg. 1 lines 20 and 23 with GQA): bool [B, Hkv, n], the entries
    whose weight [B, Hq, n] exceeds threshold for some query head of the KV head (None:
    every entry)."""
    import torch

    b, hq, n = weight.shape
    if threshold is None:
        return torch.ones(b, hkv, n, dtype=torch.bool, device=weight.device)
    return weight.view(b, hkv, hq // hkv, n).amax(dim=2) > threshold


def topk_keep(weight: torch.Tensor, threshold: float | None, groups: int,
              floor: int) -> torch.Tensor:
    """`authors` (beyond-ae KVcache_manager.py, distill and its callers): bool [B, Hq, n],
    per query head its k highest-weight entries of weight [B, Hq, n], k = the largest count
    of entries at or above threshold among the head's group of max(1, Hq // groups)
    adjacent heads (the last group may be smaller), at least `floor`, at most n (None:
    every entry). Equal weights: the earlier position first."""
    import torch

    b, hq, n = weight.shape
    if threshold is None:
        return torch.ones(b, hq, n, dtype=torch.bool, device=weight.device)
    size = max(1, hq // groups)
    ng = -(-hq // size)
    count = torch.zeros(b, ng * size, dtype=torch.int64, device=weight.device)
    count[:, :hq] = (weight >= threshold).sum(dim=-1)
    k = count.view(b, ng, size).amax(dim=-1).clamp(floor, n).repeat_interleave(size, dim=1)
    order = weight.argsort(dim=-1, descending=True, stable=True)
    ranked = torch.arange(n, device=weight.device) < k[:, :hq, None]  # rank r: kept if < k
    return torch.zeros_like(ranked).scatter_(-1, order, ranked)


def column_mean(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, n: int, *,
                scale: float) -> torch.Tensor:
    """`authors` MAW [B, Hq, n + T] of the window's n keys and T new ones after a prefill or
    append: the mean over the T queries (q [B, Hq, T, D] at positions n..) of their causal
    attention over k [B, Hkv, n + T, D] (lse [B, Hq, T]), replacing the earlier MAW
    (beyond-ae add_cache: A_gpu.sum(dim=-2) / s)."""
    from kvbench.strategies import column_scores

    return column_scores(q, k, lse, scale=scale, q_start=n) / q.shape[2]


def ingest_maw(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, n: int,
               old: torch.Tensor, *, alpha: float, w: int, scale: float) -> torch.Tensor:
    """MAW [B, Hq, n + T] of n resident keys (MAW `old` [B, Hq, n]) and T new ones after
    the T new queries (q [B, Hq, T, D] at positions n.., k [B, Hkv, n + T, D], lse
    [B, Hq, T] of their causal attention p_ij): Alg. 1 line 8 once per query, in order, as
    if the new tokens had been decoded one by one.

    p_ij is a softmax over the n + i + 1 keys query i saw, a window weight one over W
    entries; p_ij (n + i + 1) / W puts both on the scale where uniform attention is 1 / W,
    the scale of the threshold beta / W. Queries older than (1 - alpha)^m < 1e-6 weigh
    nothing and are skipped (at alpha 0.003 that is none of a few thousand); the rest go
    in chunks of at most _SCORES fp32 scores.
    """
    import torch

    a, t, m = alpha, q.shape[2], k.shape[2]
    r = t if a >= 1 else min(t, int(math.log(1e-6) / math.log(1 - a)) + 1)
    b, hq, _, d = q.shape
    g = hq // k.shape[1]
    kt = k.float().transpose(-1, -2)
    keys = torch.arange(m, device=q.device)
    new = torch.zeros(b, hq, m, dtype=torch.float32, device=q.device)
    if n:
        new[:, :, :n] = old.float() * (1 - a) ** t
    step = max(1, _SCORES // (b * hq * m))
    for i0 in range(t - r, t, step):
        i1 = min(t, i0 + step)
        c = i1 - i0
        pos = torch.arange(n + i0, n + i1, device=q.device)  # positions of these queries
        qg = q[:, :, i0:i1].float().reshape(b, -1, g * c, d)
        s = torch.matmul(qg, kt).view(b, hq, c, m) * scale
        s.masked_fill_(keys > pos[:, None], float("-inf"))
        coef = a * (1 - a) ** (n + t - 1 - pos).float() * (pos + 1).float() / w
        new += (torch.exp(s - lse[:, :, i0:i1, None]) * coef[:, None]).sum(dim=2)
    return new
