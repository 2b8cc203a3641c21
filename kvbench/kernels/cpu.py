"""The native multi-threaded CPU attention kernel (probes/attn.c) behind a torch interface.

`run` computes attention of q `[B, Hq, Lq, D]` over k/v `[B, Hkv, Lk, D]` (any strides with
a contiguous last dimension) for every (batch, KV head) row, either over all Lk positions or
over the row's selected positions idx `[B * Hkv, N]` or `[B, Hkv, N]` int32 (the first
lens[row] of them); a selection may also serve fewer query heads each (`heads` rows per
sequence, Hkv | heads | Hq: idx `[B * heads, N]`; heads = Hq gives every query head its
own list).
Rows are grouped `group` at a time into tasks for `threads` pthreads (HGCA section 3.3);
with fewer than 8 rows per thread the kernel splits each row's keys into chunks merged by
log-sum-exp (split-K), so batch-1 decode over a few KV heads uses every thread. Its inner
loops use AVX2/FMA where the CPU has them (`isa`), else portable C.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import TYPE_CHECKING

from kvbench.errors import KvbenchError

if TYPE_CHECKING:
    import torch

# Longest query block the native kernel takes (decode and append); prefill goes to torch.
MAX_NATIVE_LQ = 32


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    from kvbench.native import lib

    try:
        return lib()
    except KvbenchError:
        return None


def native_built() -> bool:
    """Whether the native library is built and loads."""
    return _lib() is not None


ISAS = ("portable", "avx2", "avx512")


def isa(force: str | None = None) -> str | None:
    """The native kernel's inner loops now in use: "avx512" (AVX-512 for float32 rows of a
    head dim that is a multiple of 16, AVX2 for the rest), "avx2" (AVX2/FMA) or "portable",
    the best the CPU has chosen on first use; `force` selects one (a set the CPU lacks
    gives the best it has below it). None when the kernel is not built."""
    so = _lib()
    if so is None:
        return None
    if force is not None and force not in ISAS:
        raise KvbenchError(f"unknown kernel instruction set '{force}' (known: {', '.join(ISAS)})")
    return ISAS[so.kvb_attn_isa(-1 if force is None else ISAS.index(force))]


def prefetch_from(nbytes: int | None = None) -> int | None:
    """The KV size in bytes from which dense calls prefetch rows ahead (probes/attn.c; half
    the LLC by default); `nbytes` sets it. None when the kernel is not built."""
    so = _lib()
    if so is None:
        return None
    return int(so.kvb_attn_prefetch_from(-1 if nbytes is None else nbytes))


_local = threading.local()  # `threads`: set in a helper thread (`helper_thread`)


def default_threads() -> int:
    """Threads for CPU attention: the CPUs this process may run on (1 in a helper thread)."""
    return getattr(_local, "threads", 0) or len(os.sched_getaffinity(0))


def helper_thread() -> None:
    """Initializer of a strategy's helper thread on a CPU-only run (a ThreadPoolExecutor's
    `initializer`): its torch ops and native calls run on the thread alone. A second thread
    that opens OpenMP regions of two threads puts more OpenMP threads than CPUs in the
    process, and libgomp then stops spinning at its barriers for every region, the caller's
    too: on the 2-core VM an idle hgca worker that had selected once slowed the decoder
    layers' native calls of the main thread by 25-100% (2026-11-27, call by call); with
    this, as without the worker."""
    import torch

    torch.get_num_threads()  # torch's per-thread set-up, which would reset the team size
    so = _lib()
    if so is not None:
        so.kvb_omp_threads(1)
    _local.threads = 1


def group_size(rows: int, threads: int) -> int:
    """HGCA's adjacent-head merging: batch x heads rows spread over `threads` tasks."""
    return max(1, math.ceil(rows / max(1, threads)))


def native_ok(q: torch.Tensor) -> bool:
    """Whether the native kernel handles this query: CPU, float32/bfloat16, Lq <= 32, built."""
    import torch

    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and q.shape[2] <= MAX_NATIVE_LQ and native_built())


def output_buffers(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Preallocated host out `[B, Hq, Lq, D]` (q's dtype) and lse `[B, Hq, Lq]` float32,
    pinned when CUDA is present so the GPU can read them directly (HGCA Fig. 9)."""
    import torch

    pin = torch.cuda.is_available()
    return (torch.empty(q.shape, dtype=q.dtype, pin_memory=pin),
            torch.empty(q.shape[:3], dtype=torch.float32, pin_memory=pin))


def run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    q_start: int,
    idx: torch.Tensor | None = None,
    lens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    group: int | None = None,
    threads: int | None = None,
    heads: int | None = None,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Call kvb_attn; returns (out, lse), writing into `out`/`lse` when given. `heads`:
    selection rows per sequence (default Hkv; sparse calls only). `keep` (sparse only)
    bool [B, Hq, N] (N = idx's width): which of its row's selected keys a query head
    attends (default all)."""
    import torch

    so = _lib()
    if so is None:
        raise KvbenchError("native attention kernel is not built: run `pip install -e .`")
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    q = q.contiguous()
    k = k if k.stride(3) == 1 else k.contiguous()
    v = v if v.stride(3) == 1 else v.contiguous()
    if out is None or lse is None:
        out, lse = output_buffers(q)
    if not (out.is_contiguous() and lse.is_contiguous() and out.shape == q.shape
            and out.dtype == q.dtype and lse.shape == q.shape[:3]
            and lse.dtype == torch.float32):
        raise KvbenchError("out/lse buffers must be contiguous [B, Hq, Lq, D] / [B, Hq, Lq] "
                           "float32 matching q")
    nt = threads or default_threads()
    hs = heads or hkv
    if hs % hkv or hq % hs or (idx is None and hs != hkv):
        raise KvbenchError(f"{hs} selection rows per sequence: need Hkv={hkv} | rows | Hq={hq}"
                           " (Hkv when dense)")
    rows = b * hs
    ks = (ctypes.c_int64 * 3)(*k.stride()[:3])
    vs = (ctypes.c_int64 * 3)(*v.stride()[:3])
    nmax = ldi = ldk = 0
    if idx is not None:  # [rows, N] or [B, heads, N]; lens [rows] or [B, heads]
        assert lens is not None and idx.dtype == torch.int32
        nmax = idx.shape[-1]
        assert idx.numel() == rows * nmax and lens.numel() == rows
        idx, ldi = _row_major(idx)
        if lens.dtype != torch.int32 or not lens.is_contiguous():
            lens = lens.to(torch.int32).contiguous()
    if keep is not None:
        assert idx is not None and keep.shape == (b, hq, nmax) and keep.dtype == torch.bool
        keep, ldk = _row_major(keep)
    rc = so.kvb_attn(0 if q.dtype == torch.float32 else 1, q.data_ptr(), k.data_ptr(),
                     v.data_ptr(), out.data_ptr(), lse.data_ptr(), b, hq, hkv, lq, lk, d, ks, vs,
                     None if idx is None else idx.data_ptr(),
                     None if lens is None else lens.data_ptr(),
                     None if keep is None else keep.data_ptr(), nmax, ldi, ldk, hs, scale,
                     int(causal), q_start, group or group_size(rows, nt), nt)
    if rc != 0:
        raise KvbenchError("native attention kernel could not allocate its work buffers")
    return out, lse


def _row_major(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(t, the elements between its rows) for t [..., N] whose rows lie evenly spaced with a
    contiguous last dimension (e.g. the first N columns of a wider buffer: no copy), else
    (a contiguous copy, N)."""
    n, ld, lead = t.shape[-1], t.stride(-2), t.shape[:-1]
    # row (i0, i1, ...) at ld times its flat index: each leading dimension's stride is ld
    # times the rows below it (a dimension of size 1 has no stride to keep)
    below = [math.prod(lead[i + 1:]) for i in range(len(lead))]
    if t.stride(-1) == 1 and ld >= n and all(
            size == 1 or stride == ld * rows
            for size, stride, rows in zip(lead, t.stride()[:-1], below, strict=True)):
        return t, ld
    t = t.contiguous()
    return t, n


MAX_GEMV_ROWS = 8  # activation rows probes/gemv.c takes per call


def gemv_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `gemv` applies: CPU float32, W [N, K] and x [..., K] contiguous, x with at
    most MAX_GEMV_ROWS rows, the library built."""
    import torch

    return (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32
            and w.is_contiguous() and x.is_contiguous() and x.shape[-1] == w.shape[1]
            and 1 <= x.numel() // max(x.shape[-1], 1) <= MAX_GEMV_ROWS and native_built())


def gemv(x: torch.Tensor, w: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """x [..., K] @ W^T for W [N, K] row-major (nn.Linear's layout) -> [..., N]: decode's
    matmul as one stream of W through `threads` threads (probes/gemv.c); callers check
    `gemv_ok` first."""
    import torch

    n, k = w.shape
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)  # the one torch op of the call
    got = _lib().kvb_gemv(w.data_ptr(), x.data_ptr(), y.data_ptr(), n, k, x.numel() // k, k,
                          threads or torch.get_num_threads())
    if got != 0:
        raise KvbenchError(f"native gemv failed ({got}) for x {tuple(x.shape)}")
    return y


MAX_NORM_ROWS = 64  # rows probes/norm.c takes per call (decode's); prefill goes to torch


def rms_norm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `rms_norm` applies: CPU float32, x [..., D] contiguous with at most
    MAX_NORM_ROWS rows, w [D] contiguous, the library built."""
    import torch

    return (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32
            and x.is_contiguous() and w.is_contiguous() and w.dim() == 1
            and x.shape[-1] == w.shape[0] and x.numel() <= MAX_NORM_ROWS * w.shape[0]
            and native_built())


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """w * x / sqrt(mean(x^2, -1) + eps) for x [..., D] in one native call (probes/norm.c);
    callers check `rms_norm_ok` first."""
    import torch

    y = torch.empty_like(x)
    d = w.shape[0]
    _lib().kvb_rmsnorm(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.numel() // d, d, eps)
    return y


def greedy(logits: torch.Tensor, isa: int = -1) -> torch.Tensor:
    """Greedy decoding's tokens [B] int64 for logits [B, vocab], as torch's argmax gives them
    (the first maximal value; a NaN above every number): one native call for CPU float32
    row-major logits (probes/greedy.c; torch's own took 60-90 us of a KV-bound decode step
    over SmolLM2's 49152 entries), else torch's. `isa` 0 forces the portable loops."""
    import torch

    if not (logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.dim() == 2 and logits.shape[1] > 0 and logits.is_contiguous()
            and native_built()):
        return logits.argmax(-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if _lib().kvb_argmax(logits.data_ptr(), logits.shape[0], logits.shape[1],
                         out.data_ptr(), isa, torch.get_num_threads()) != 0:
        raise KvbenchError("native argmax: out of memory")
    return out


def topk_ok(x: torch.Tensor, k: int) -> bool:
    """Whether `topk` applies: CPU float32 x [..., n] with a contiguous last dimension,
    1 <= k <= n < 2^31, the library built."""
    import torch

    return (x.device.type == "cpu" and x.dtype == torch.float32
            and 1 <= k <= x.shape[-1] < 1 << 31 and x.stride(-1) == 1 and native_built())


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k, dim=-1) in one native call (probes/topk.c): values [..., k] and
    their int64 indices, best first, on a tie the lower index first (torch leaves that
    order open). torch's took 1.7 ms for 4 x 9 rows of 8000 and k 1024 (InfiniGen's
    speculation at the KV-bound point), this 0.5. Callers check `topk_ok` first."""
    import torch

    n = x.shape[-1]
    rows = x.reshape(-1, n)  # a view where x's rows are evenly spaced
    if rows.stride(0) < n:  # rows that overlap (an expanded view): copied apart
        rows = rows.contiguous()
    vals = torch.empty(*x.shape[:-1], k, dtype=torch.float32)
    idx = torch.empty(*x.shape[:-1], k, dtype=torch.int64)
    if _lib().kvb_topk_rows(rows.data_ptr(), rows.shape[0], n, rows.stride(0), k,
                            vals.data_ptr(), idx.data_ptr(), torch.get_num_threads()) != 0:
        raise KvbenchError("native top-k: out of memory")
    return vals, idx


def maw_ok(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, maw: torch.Tensor) -> bool:
    """Whether `maw_update` applies: CPU float32 throughout, q [B, Hq, 1, D], lse and maw
    contiguous, k's last dimension contiguous, the library built."""
    import torch

    return (q.device.type == "cpu" and q.shape[2] == 1 and k.stride(3) == 1
            and all(x.dtype == torch.float32 for x in (q, k, lse, maw))
            and lse.is_contiguous() and maw.is_contiguous() and native_built())


def maw_update(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, maw: torch.Tensor, *,
               scale: float, alpha: float, slot: int, threads: int | None = None) -> None:
    """HGCA's MAW update in place (probes/maw.c): maw [B, Hq, N] <- (1 - alpha) maw + alpha
    softmax weights of q [B, Hq, 1, D] over k [B, Hkv, N, D] (lse [B, Hq, 1] of that
    softmax); slot >= 0 takes its weight alone. Callers check `maw_ok` first."""
    import torch

    b, hq, _, d = q.shape
    q = q.contiguous()
    ks = (ctypes.c_int64 * 3)(*k.stride()[:3])
    _lib().kvb_maw(q.data_ptr(), k.data_ptr(), lse.data_ptr(), maw.data_ptr(), b, hq,
                   k.shape[1], k.shape[2], d, ks, scale, alpha, slot,
                   threads or torch.get_num_threads())


@contextmanager
def cold_kv() -> Iterator[None]:
    """Dense calls prefetch whatever their KV's size for the block: a decode step reads
    every layer's weights and KV, far past the last-level cache, before it reads one
    layer's KV again, so that KV is cold however small it is. (The half-LLC default,
    measured on calls repeated over one KV, which then stays in cache, is for such calls:
    the probes.) Measured on the 2-core VM, interleaved over 12 rounds: 8 layers of 1024
    keys x 12 float32 rows, each read after 28 MB of other reads as a decode step does,
    3.39 ms without, 2.22 ms with."""
    before = prefetch_from()
    if before is None:
        yield
        return
    prefetch_from(0)
    try:
        yield
    finally:
        prefetch_from(before)


def digest_token(k: torch.Tensor, n0: int, lo: torch.Tensor, hi: torch.Tensor,
                 page: int) -> bool:
    """Quest's min/max digests lo/hi [B, Hkv, P, D] after the token at position n0 of the
    key cache k [B, Hkv, >= n0 + 1, D], in one native call (probes/pages.c); returns False,
    doing nothing, where it does not apply (not CPU float32 with contiguous channels, or no
    library)."""
    import torch

    if not (k.device.type == "cpu" and k.dtype == lo.dtype == hi.dtype == torch.float32
            and k.stride(3) == 1 and lo.stride(3) == 1 and hi.stride() == lo.stride()
            and native_built()):
        return False
    b, h, _, d = k.shape
    ks = (ctypes.c_int64 * 2)(*k.stride()[:2])
    ds = (ctypes.c_int64 * 3)(*lo.stride()[:3])
    _lib().kvb_digest_token(k.data_ptr() + n0 * k.stride(2) * k.element_size(), ks, lo.data_ptr(),
                            hi.data_ptr(), ds, b, h, d, n0 // page, int(n0 % page == 0))
    return True


def page_select_ok(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> bool:
    """Whether `page_select` applies: CPU float32 q [B, Hq, 1, D] and digests with a
    contiguous last dimension, the library built."""
    import torch

    return (q.device.type == "cpu" and q.dtype == lo.dtype == hi.dtype == torch.float32
            and q.shape[2] == 1 and lo.stride(-1) == 1 and hi.stride() == lo.stride()
            and native_built())


def page_select(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, n_pages: int, k: int,
                sinks: int, window: int, per: str, page: int, n: int,
                threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest's selection in one call (probes/pages.c): page scores of q [B, Hq, 1, D]
    against digests lo/hi [B, Hkv, >= n_pages, D] per KV head (`per` "kv": the group's q
    summed) or per query head, the sinks, window and top-k pages (k < n_pages), their token
    positions < n. Returns (pos int32 [B, H, k * page], lens int32 [B, H]): a row's first
    lens positions, ascending, the rest 0, as kvbench.strategies._pages.page_tokens gives
    them for select_pages' pages. Callers check `page_select_ok` first."""
    import torch

    b, hq, _, d = q.shape
    hkv = lo.shape[1]
    h = hkv if per != "query" else hq
    pos = torch.empty(b, h, k * page, dtype=torch.int32)
    lens = torch.empty(b, h, dtype=torch.int32)
    strides = (ctypes.c_int64 * 3)(*lo.stride()[:3])
    qc = q if q.is_contiguous() else q.contiguous()
    got = _lib().kvb_page_select(qc.data_ptr(), b, hq, hkv, d, lo.data_ptr(), hi.data_ptr(),
                                 strides, n_pages, k, sinks, window, int(per != "query"),
                                 page, n, pos.data_ptr(), lens.data_ptr(),
                                 threads or torch.get_num_threads())
    if got != 0:
        raise KvbenchError(f"native page selection failed ({got})")
    return pos, lens
