"""HGCA's parameters and per-layer KV state (HGCA paper section 3.2, Algorithm 1), used by
strategies.hgca.

The accelerator holds a ring of fixed-size blocks, k/v [B, Hkv, W, D], with a moving
average of attention weights (MAW) per resident entry and query head, [B, Hq, W]. The
host holds KV_cpu (every evicted entry, k/v [B, Hkv, N, D]) and the contextual cache
KV_ctx: per (batch, KV head) row the selected entries, stored contiguously ([B, Hkv, N, D]
with per-row lengths), which is what the host's sparse attention reads. Only the CPU reads
KV_cpu and KV_ctx (native kernel, gathers), so they are pageable; the eviction staging that
the side stream's D2H writes is exactly sized and pinned on CUDA (strategies._hostcopy,
GPU audit finding 3).
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbench.errors import require
from kvbench.kernels.cpu import default_threads
from kvbench.strategies import _budget
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
    cpu_threads: int = field(default=0, metadata={
        "help": "Threads of the host sparse attention (0: this process's CPUs, less one "
                "where CUDA is present, for the thread that launches the GPU work; the run "
                "records the number)."})

    window_blocks: int = field(default=0, metadata={
        "derived": True, "help": "Blocks in the accelerator window (set by the run)."})

    def __post_init__(self) -> None:
        require(self.beta >= 0, f"--beta {self.beta}: must be >= 0")
        _budget.check(self.gpu_share, self.gpu_tokens)
        require(0 < self.alpha <= 1, f"--alpha {self.alpha}: must be in (0, 1]")
        require(self.block >= 0, f"--block {self.block}: must be at least 1 (0: automatic)")
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


class LayerKV:
    """One layer: ring + MAW on the accelerator, KV_cpu and KV_ctx on the host, worker jobs."""

    def __init__(self, ctx: RunContext, w: int, block: int) -> None:
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
        self.ck = torch.empty(b, hkv, n, d, dtype=hd)  # KV_ctx, contiguous per row
        self.cv = torch.empty_like(self.ck)
        self.lens = torch.zeros(b * hkv, dtype=torch.int32)
        self.cpos = torch.empty(b * hkv, n, dtype=torch.int32)  # KV_ctx entries' positions
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
    def nbytes(ctx: RunContext, w: int, block: int) -> tuple[int, int]:
        """(accelerator, host) bytes one layer allocates (the output buffers included)."""
        s, b = ctx.spec, ctx.batch
        hkv, hq, d = s.n_kv_heads, s.n_heads, s.head_dim
        he = host_dtype(ctx.dtype).itemsize
        accel = b * w * (2 * hkv * d * ctx.elem_bytes + hq * 4)  # ring k/v, MAW
        host = b * hkv * (d * he * (4 * ctx.max_len + 2 * block) + 4 * ctx.max_len + 4)
        # KV_cpu, KV_ctx, staging, KV_ctx positions and row lengths
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

    def keep(self, k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor,
             threshold: float | None, first: int) -> None:
        """KV_ctx[row] += the entries of k/v [B, Hkv, n, D] (positions first, first + 1, ...)
        whose weight [B, Hq, n] exceeds threshold for some query head of the row's KV head
        (None: every entry), in order."""
        import torch

        b, hkv, n, d = k.shape
        g = weight.shape[1] // hkv
        score = weight.view(b, hkv, g, n).amax(dim=2).reshape(b * hkv, n)
        keep = torch.ones_like(score, dtype=torch.bool) if threshold is None else score > threshold
        rows, j = keep.nonzero(as_tuple=True)
        pos = self.lens.long()[rows] + (keep.long().cumsum(dim=1) - 1)[rows, j]
        ck, cv = self.ck.view(b * hkv, -1, d), self.cv.view(b * hkv, -1, d)
        ck[rows, pos] = k.reshape(b * hkv, n, d)[rows, j]
        cv[rows, pos] = v.reshape(b * hkv, n, d)[rows, j]
        self.cpos[rows, pos] = (first + j).to(torch.int32)
        self.lens += keep.sum(dim=1, dtype=torch.int32)


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
