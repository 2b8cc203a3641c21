"""Dense attention with its log-sum-exp, and the exact log-sum-exp merge (HGCA section 3.3).

Layout everywhere: q `[B, Hq, Lq, D]`, k and v `[B, Hkv, Lk, D]` with Hq a multiple of Hkv
(grouped-query attention: query head h reads KV head h // (Hq // Hkv)); out `[B, Hq, Lq, D]`
in q's dtype; lse `[B, Hq, Lq]` float32, natural log of the sum of exp(scale * q.k) over the
keys a query attended to (-inf when it attended to none, in which case its out row is 0).

Causal means the Lq queries sit at absolute key positions q_start .. q_start + Lq - 1
(default q_start = Lk - Lq, the last Lq positions: prefill when Lq == Lk, append when
Lq <= 32, decode when Lq == 1) and query i sees keys 0 .. q_start + i. A caller that splits
the keys into parts passes each part's q_start so that the parts merge into full attention.

On the CPU, float32 and bfloat16 decode/append (Lq <= 32) run the native multi-threaded
kernel (kvbench.kernels.cpu). On CUDA, torch's fused attention kernels that return the
log-sum-exp run it (`fused_attention`: flash, else memory-efficient; their causal mask is
used only on a square block, so causal attention is split into a part every query sees and
that block, merged by lse). Everything else (CPU prefill, other dtypes, a fused kernel that
refuses the shapes) runs the torch path below, query-chunked so a prefill does not
materialise all scores at once (`query_chunk`: a GPU-sized budget on CUDA). Every call
counts the backend that ran (`backend_use`: "native", "sdpa-flash", "sdpa-efficient" or
"torch"; sparse strategies add their selection's path, "native-select" or "torch-select",
and page gathers "native-pages"; a decode step run whole in one native call, every layer's
attention and selection in it, is "native-step", kvbench.kernels.step), which runs and
probes store as `method.backend`;
`kvbench.native.native_status` says why the native library did not load (`kvbench env`
shows it).

`prompt_attention(q, k, v, result)` holds one prompt's attention for a shared prefill
(kvbench.runtime.prefill): inside it, the call over that prompt (this very q, keys and values
equal to k/v, causal from position 0) returns `result` instead of computing it; with result
None the call computes it and keeps it for the recording run.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbench.errors import KvbenchError, require
from kvbench.timing import kernel

if TYPE_CHECKING:
    import torch

# Most float32 score elements one query chunk of the torch path may hold at a time: on the
# CPU (64 MiB), and on CUDA (1 GiB; with its exp, 2-3 GiB of temporaries), where a CPU-sized
# budget meant ~10^7 launches for a 32K prefill at batch 8 x 32 heads (2 queries a chunk).
_MAX_SCORES = 1 << 24
_MAX_SCORES_CUDA = 1 << 28

# A fused kernel: (q [B, H, Lq, D], k/v [B, H, Lk, D], causal on a square block, scale)
# -> (out [B, H, Lq, D] in q's dtype, lse [B, H, Lq] float32).
Fused = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", bool, float],
                 tuple["torch.Tensor", "torch.Tensor"]]
# (kernel, dtype, head dim) a fused kernel refused once: not tried again in this process
_REFUSED: set[tuple[str, object, int]] = set()

# (backend, phase) -> attention calls since the last `backend_use(reset=True)`
_USE: Counter[tuple[str, str]] = Counter()


def note_backend(backend: str, q: torch.Tensor, append: bool = False) -> None:
    """Count one attention call of q `[B, Hq, Lq, D]` on `backend` ("native", "torch" or a
    fused CUDA kernel, "sdpa-flash" / "sdpa-efficient");
    phase "decode" when Lq == 1, else (or for a prompt's last query, `append`)
    "prefill/append"."""
    _USE[(backend, "decode" if q.shape[2] == 1 and not append else "prefill/append")] += 1


def backend_use(reset: bool = False) -> dict[str, str]:
    """phase -> backends that ran it since the last reset (e.g. "native", "torch" or
    "native+torch"), as stored in records' `method.backend`; empty when nothing ran."""
    out: dict[str, set[str]] = {}
    for backend, phase in _USE:
        out.setdefault(phase, set()).add(backend)
    if reset:
        _USE.clear()
    return {phase: "+".join(sorted(b)) for phase, b in sorted(out.items())}


@dataclass
class PromptAttention:
    """A layer's prompt attention: q [B, Hq, P, D], k/v [B, Hkv, P, D] and, once known,
    result = (out [B, Hq, P, D], lse [B, Hq, P])."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    result: tuple[torch.Tensor, torch.Tensor] | None = None

    def matches(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                start: int, scale: float) -> bool:
        """Whether dense_attention(q, k, v) is this prompt's causal attention at the default
        scale (the keys compared element by element: O(P D), against the call's O(P^2 D))."""
        import torch

        return (q is self.q and causal and start == 0 and scale == q.shape[3] ** -0.5
                and k.shape == self.k.shape
                and torch.equal(k, self.k) and torch.equal(v, self.v))


_PROMPT: list[PromptAttention] = []


@contextlib.contextmanager
def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     result: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> Iterator[PromptAttention]:
    """Within: `dense_attention` over this prompt returns `result` (replay), or computes it
    and keeps it in the yielded PromptAttention (record: result None)."""
    memo = PromptAttention(q, k, v, result)
    _PROMPT.append(memo)
    try:
        yield memo
    finally:
        _PROMPT.pop()


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate shapes, dtypes and devices; returns (B, Hq, Hkv, D). KvbenchError if bad.

    This runs on every attention call: the messages are built only when a check fails."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise KvbenchError(f"attention needs 4-D q/k/v [B, H, L, D], got {q.dim()}-D/"
                           f"{k.dim()}-D/{v.dim()}-D")
    if k.shape != v.shape:
        raise KvbenchError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    if k.shape[0] != b or k.shape[3] != d:
        raise KvbenchError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch or "
                           "head dimension")
    if hkv <= 0 or hq % hkv:
        raise KvbenchError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if not (q.dtype == k.dtype == v.dtype and q.dtype.is_floating_point):
        raise KvbenchError(f"q/k/v must share one float dtype, got {q.dtype}/{k.dtype}/"
                           f"{v.dtype}")
    if not q.device == k.device == v.device:
        raise KvbenchError(f"q/k/v must be on one device, got {q.device}/{k.device}/"
                           f"{v.device}")
    return b, hq, hkv, d


def empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The result of attending to nothing: out zeros `[B, Hq, Lq, D]`, lse -inf `[B, Hq, Lq]`."""
    import torch

    return (torch.zeros_like(q),
            torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device))


@kernel
def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    q_start: int | None = None,
    backend: str = "auto",
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q over all of k/v, returning (out, lse) as the module describes.

    q `[B, Hq, Lq, D]`, k/v `[B, Hkv, Lk, D]`; `scale` defaults to D ** -0.5; `q_start`
    (causal only) is the absolute key position of query 0, default Lk - Lq. `backend` is
    "auto" (native CPU kernel where it applies, a fused kernel on CUDA, else the torch
    path), "native" or "torch" (the chunked torch path); `threads` caps the native
    kernel's threads (default: every CPU this process may use).
    """
    d = check_qkv(q, k, v)[3]
    require(backend in ("auto", "native", "torch"), f"unknown attention backend '{backend}'")
    lq, lk = q.shape[2], k.shape[2]
    scale = d ** -0.5 if scale is None else float(scale)
    start = lk - lq if q_start is None else int(q_start)
    if lk == 0 or lq == 0 or q.shape[0] == 0:
        return empty_result(q)
    memo = _PROMPT[-1] if _PROMPT and _PROMPT[-1].matches(q, k, v, causal, start,
                                                          scale) else None
    if memo is not None and memo.result is None:  # recording: computed once, kept
        memo.result = _attend(q, k, v, causal, scale, start, backend, threads)
    if memo is not None:
        return memo.result
    return _attend(q, k, v, causal, scale, start, backend, threads)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
            start: int, backend: str, threads: int | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """dense_attention's computation on the backend that applies (arguments resolved)."""
    from kvbench.kernels import cpu

    native = cpu.native_ok(q)
    require(backend != "native" or native, "the native kernel needs CPU float32/bfloat16 "
            f"tensors with Lq <= {cpu.MAX_NATIVE_LQ} and a built kvbench._native")
    if native and backend != "torch":
        note_backend("native", q)
        return cpu.run(q, k, v, scale=scale, causal=causal, q_start=start, threads=threads)
    if q.is_cuda and backend == "auto":
        fused = fused_attention(q, k, v, scale, causal, start)
        if fused is not None:
            note_backend(fused[2], q)
            return fused[0], fused[1]
    note_backend("torch", q)
    return torch_attention(q, k, v, scale, causal, start)


def fused_parts(lq: int, lk: int, causal: bool, q_start: int
                ) -> list[tuple[int, int, bool]] | None:
    """Key ranges (k0, k1, causal) whose partial attentions, merged by lse, are the
    attention of Lq queries over Lk keys (query i sees keys <= q_start + i when causal):
    keys before q_start every query sees (no mask), then the square block q_start ..
    q_start + Lq - 1 under the fused kernels' causal mask (the one shape where their
    upper-left and lower-right alignments agree). None when that block does not fit in
    the keys, or queries precede them (q_start < 0): the torch path does those."""
    if not causal or q_start >= lk - 1:  # every query sees every key
        return [(0, lk, False)]
    if q_start < 0 or q_start + lq > lk:
        return None
    return [(0, q_start, False)] * (q_start > 0) + [(q_start, q_start + lq, True)]


def fused_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              parts: list[tuple[int, int, bool]], op: Fused
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q `[B, Hq, Lq, D]` over k/v `[B, Hkv, Lk, D]` by `op` over each of
    `parts` (fused_parts), merged by lse. Grouped-query heads: an unmasked part folds each
    KV head's query heads into its query length ([B, Hkv, G * Lq, D], one call); the causal
    block runs once per head offset j in the group (query heads j, G + j, ... read KV heads
    0, 1, ...), so no K/V is copied G times."""
    import torch

    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    got: list[tuple[torch.Tensor, torch.Tensor]] = []
    for k0, k1, causal in parts:
        kp, vp = k[:, :, k0:k1], v[:, :, k0:k1]
        if not causal:
            o, lse = op(q.reshape(b, hkv, g * lq, d), kp, vp, False, scale)
            o, lse = o.reshape(b, hq, lq, d), lse.reshape(b, hq, lq)
        else:
            o = torch.empty_like(q)
            lse = torch.empty(b, hq, lq, dtype=torch.float32, device=q.device)
            for j in range(g):
                o[:, j::g], lse[:, j::g] = op(q[:, j::g], kp, vp, True, scale)
        got.append((o, lse))
    out, lse = got[0]
    for part in got[1:]:
        out, lse = merge(out, lse, *part)
    return out, lse


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    got = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                            scale=scale)
    return got[0], got[1]


def _efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    got = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0,
                                                                causal, scale=scale)
    return got[0], got[1][:, :, :q.shape[2]]  # its lse rows are padded to a multiple of 32


FUSED: dict[str, Fused] = {"sdpa-flash": _flash, "sdpa-efficient": _efficient}


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool, q_start: int
                    ) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """(out, lse, kernel name) by the first of FUSED that accepts the shapes and dtype
    (flash: half types; memory-efficient: float32 too), or None (fused_parts has no split,
    or every kernel refused: the caller runs the torch path). A refusal is remembered per
    (kernel, dtype, head dim)."""
    import torch

    parts = fused_parts(q.shape[2], k.shape[2], causal, q_start)
    if parts is None:
        return None
    for name, op in FUSED.items():
        key = (name, q.dtype, q.shape[3])
        if key in _REFUSED:
            continue
        try:
            return (*fused_run(q, k, v, scale, parts, op), name)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:  # no kernel for these shapes/dtype on this GPU or build
            _REFUSED.add(key)
    return None


def query_chunk(b: int, hq: int, lk: int, cuda: bool) -> int:
    """Queries per chunk of the torch path: as many as keep B * Hq * chunk * Lk float32
    scores within the budget (_MAX_SCORES, or _MAX_SCORES_CUDA on CUDA), at least one."""
    return max(1, (_MAX_SCORES_CUDA if cuda else _MAX_SCORES) // max(1, b * hq * lk))


@kernel
def torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool, q_start: int, key_pos: torch.Tensor | None = None,
                    keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference-quality torch path: float32 scores and softmax, chunked over queries.

    `key_pos` `[B, Hkv, Lk]` gives each key's absolute position (default 0 .. Lk-1; -1
    marks padding that no query sees), so gathered sparse keys use the same path. `keep`
    `[B, Hq, Lk]` bool: the keys each query head sees (default all).
    """
    import torch

    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = hq // hkv
    # CUDA half types: matmuls read k/v in place and accumulate into float32 outputs.
    half_cuda = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    kc = k if half_cuda else k.float()
    vc = v if half_cuda else v.float()
    out = torch.empty(b, hkv, g, lq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hkv, g, lq, dtype=torch.float32, device=q.device)
    qg = q.reshape(b, hkv, g, lq, d)
    chunk = query_chunk(b, hq, lk, q.is_cuda)
    if key_pos is None:
        keys = torch.arange(lk, device=q.device).view(1, 1, 1, lk)
    else:
        keys = key_pos.to(q.device).reshape(b * hkv, 1, 1, lk)
    for i0 in range(0, lq, chunk):
        i1 = min(lq, i0 + chunk)
        c = i1 - i0
        qc = qg[:, :, :, i0:i1].reshape(b * hkv, g * c, d)
        kt = kc.reshape(b * hkv, lk, d).transpose(1, 2)
        s = torch.bmm(qc, kt, out_dtype=torch.float32) if half_cuda else torch.bmm(qc.float(), kt)
        s = s.mul_(scale).view(b * hkv, g, c, lk)
        if causal:
            limit = q_start + torch.arange(i0, i1, device=q.device)
            s.masked_fill_(keys > limit.view(1, 1, c, 1), float("-inf"))
        if key_pos is not None:
            s.masked_fill_(keys < 0, float("-inf"))
        if keep is not None:
            s.masked_fill_(~keep.to(q.device).view(b * hkv, g, 1, lk), float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m)
        denom = p.sum(dim=-1)
        pv = p.view(b * hkv, g * c, lk)
        vr = vc.reshape(b * hkv, lk, d)
        if half_cuda:
            o = torch.bmm(pv.to(v.dtype), vr, out_dtype=torch.float32)
        else:
            o = torch.bmm(pv, vr)
        o = o.view(b, hkv, g, c, d)
        dn = denom.view(b, hkv, g, c)
        o = torch.where(dn[..., None] > 0, o / dn.clamp_min(1e-38)[..., None], 0.0)
        out[:, :, :, i0:i1] = o.to(q.dtype)
        lse[:, :, :, i0:i1] = m.view(b, hkv, g, c) + torch.log(dn)
    return out.view(b, hq, lq, d), lse.view(b, hq, lq)


@kernel
def merge(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact log-sum-exp merge of two partial attentions over disjoint key sets (HGCA 3.3).

    o1/o2 `[..., D]` with lse1/lse2 `[...]` (float32, -inf for a part that attended to
    nothing); returns (out in o1's dtype on o1's device, lse float32):
    out = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2), lse = log(e^lse1 + e^lse2).
    A part on another device (the CPU part of a hybrid step) is moved to o1's device.
    """
    import torch

    require(o1.shape == o2.shape and lse1.shape == lse2.shape == o1.shape[:-1],
            f"merge needs matching parts, got {tuple(o1.shape)}/{tuple(lse1.shape)} and "
            f"{tuple(o2.shape)}/{tuple(lse2.shape)}")
    dev = o1.device
    lse1 = lse1.float()
    lse2 = lse2.to(dev, non_blocking=True).float()
    # part 1's weight e^lse1 / (e^lse1 + e^lse2) = sigmoid(lse1 - lse2), in few small ops
    # (this runs once per layer and step); NaN only when both parts are empty, where the
    # output is 0
    a1 = torch.sigmoid(lse1 - lse2).unsqueeze(-1)
    out = torch.lerp(o2.to(dev, non_blocking=True).float(), o1.float(), a1)
    lse = torch.logaddexp(lse1, lse2)
    out.masked_fill_(torch.isneginf(lse).unsqueeze(-1), 0.0)
    return out.to(o1.dtype), lse
