"""CPU sparse attention over per-head selected KV positions (HGCA section 3.3, Fig. 9).

Each (batch, KV head) row attends to its own variable-length list of selected positions of
the host-resident KV cache (HGCA's per-head sparsification, section 3.2.2; with grouped
query attention the G query heads of a KV head share its selection; `keep` narrows it per
query head, as HGCA's per-head top-k over a KV head's union does). The lists are packed
into one index tensor padded to a common length N (`lens` marks the valid prefix of each
row, so padding is never attended), rows are merged into tasks of adjacent heads sized
batch x heads / threads, and a pool of native threads writes one preallocated output
(pinned when CUDA is present), ready to be merged with the GPU's part by
kvbench.kernels.merge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbench.errors import require
from kvbench.kernels.attention import check_qkv, empty_result, note_backend, torch_attention
from kvbench.timing import kernel

if TYPE_CHECKING:
    import torch

@dataclass(frozen=True)
class Selection:
    """Packed, validated selected positions: idx `[B * Hkv, N]` int32 (padded with 0), lens
    `[B * Hkv]` int32, every valid position below `lk`. Pack once per selection and pass it
    to every step: packing runs torch ops whose OpenMP threads would otherwise spin on the
    cores the native kernel's threads need."""

    idx: torch.Tensor
    lens: torch.Tensor
    lk: int


def pack_indices(
    indices: torch.Tensor | Sequence[Sequence[torch.Tensor]],
    b: int,
    hkv: int,
    lk: int,
    lengths: torch.Tensor | None = None,
) -> Selection:
    """Selected positions packed as a Selection (rows padded to a common length N).

    `indices` is a tensor `[B, Hkv, N]` (all N valid, or the first lengths[b, h] when
    `lengths` `[B, Hkv]` is given) or a nested sequence [B][Hkv] of 1-D position tensors.
    Every valid position must lie in [0, Lk); KvbenchError otherwise.
    """
    import torch

    if isinstance(indices, torch.Tensor):
        require(indices.dim() == 3 and tuple(indices.shape[:2]) == (b, hkv),
                f"indices must be [B={b}, Hkv={hkv}, N], got {tuple(indices.shape)}")
        n = indices.shape[2]
        idx = indices.reshape(b * hkv, n).to("cpu", torch.int32)
        if lengths is None:
            lens = torch.full((b * hkv,), n, dtype=torch.int32)
        else:
            require(tuple(lengths.shape) == (b, hkv), f"lengths must be [B={b}, Hkv={hkv}]")
            lens = lengths.reshape(-1).to("cpu", torch.int32)
            require(bool(((lens >= 0) & (lens <= n)).all()), f"lengths must lie in [0, {n}]")
    else:
        require(len(indices) == b and all(len(row) == hkv for row in indices),
                f"indices must be a [B={b}][Hkv={hkv}] nested sequence of 1-D tensors")
        flat = [torch.as_tensor(t).reshape(-1) for row in indices for t in row]
        lens = torch.tensor([t.numel() for t in flat], dtype=torch.int32)
        idx = torch.zeros(b * hkv, int(lens.max()) if len(flat) else 0, dtype=torch.int32)
        for r, t in enumerate(flat):
            idx[r, : t.numel()] = t.to(torch.int32)
    valid = torch.arange(idx.shape[1]).view(1, -1) < lens.view(-1, 1)
    sel = idx[valid]
    require(sel.numel() == 0 or (int(sel.min()) >= 0 and int(sel.max()) < lk),
            f"selected positions must lie in [0, {lk})")
    return Selection(idx.contiguous(), lens.contiguous(), lk)


@kernel
def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor | Sequence[Sequence[torch.Tensor]] | Selection,
    *,
    lengths: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    q_start: int | None = None,
    group: int | None = None,
    threads: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q `[B, Hq, Lq, D]` over the selected positions of k/v `[B, Hkv, Lk, D]`.

    Returns (out `[B, Hq, Lq, D]` in q's dtype, lse `[B, Hq, Lq]` float32), written into
    `out`/`lse` when given (kvbench.kernels.cpu.output_buffers makes pinned ones). Causal
    queries sit at positions q_start + i (default Lk - Lq) and skip later selected keys.
    `group` rows per task and `threads` default to HGCA's batch x heads / threads split.
    `indices` is a Selection from pack_indices or what pack_indices takes. `keep` bool
    `[B, Hq, N]` (N: the selection's width): the j-th selected key of its KV head's row is
    attended by query head h only where keep[b, h, j] (default: by all of the group); the
    group's keys are still read once for all its heads.
    Off the native kernel's reach (CUDA, float16, Lq > 32) the keys are gathered and the
    torch path runs instead; the rows' padding gathers position 0 (or whatever the index
    holds past lens), whose k/v are zeroed there, so a NaN or inf outside a row's selection
    never reaches its output.
    """
    import torch

    from kvbench.kernels import cpu

    b, _, hkv, d = check_qkv(q, k, v)
    lq, lk = q.shape[2], k.shape[2]
    sel = indices if isinstance(indices, Selection) else pack_indices(indices, b, hkv, lk,
                                                                       lengths)
    require(sel.idx.shape[0] == b * hkv and sel.lk <= lk,
            f"selection for {sel.idx.shape[0]} rows below {sel.lk} does not fit B x Hkv = "
            f"{b * hkv} rows of {lk} positions")
    idx, lens = sel.idx, sel.lens
    require(keep is None or (tuple(keep.shape) == (b, q.shape[1], idx.shape[1])
                             and keep.dtype == torch.bool),
            f"keep must be bool [B={b}, Hq={q.shape[1]}, N={idx.shape[1]}] (N: the "
            "selection's width)")
    scale = d ** -0.5 if scale is None else float(scale)
    start = lk - lq if q_start is None else int(q_start)
    if idx.shape[1] == 0 or lq == 0 or b == 0:
        o, s = empty_result(q)
        if out is None or lse is None:
            return o, s
        out.copy_(o)
        lse.copy_(s)
        return out, lse
    if cpu.native_ok(q):
        note_backend("native", q)
        return cpu.run(q, k, v, scale=scale, causal=causal, q_start=start, idx=idx, lens=lens,
                       out=out, lse=lse, group=group, threads=threads, keep=keep)
    note_backend("torch", q)
    n = idx.shape[1]
    pos = idx.to(torch.int64).view(b, hkv, n)
    pad = torch.arange(n).view(1, 1, n) >= lens.view(b, hkv, 1)  # [B, Hkv, N], on the host
    gather = pos.to(q.device)[..., None].expand(b, hkv, n, d)
    kg, vg = k.gather(2, gather), v.gather(2, gather)  # [B, Hkv, N, D]
    if bool(pad.any()):
        # a padded slot gets weight 0, but 0 x NaN/inf is NaN: what it gathered (scout's
        # non-resident blocks are NaN, png-kv's empty pool slots never written) is zeroed
        hole = pad.to(q.device)[..., None]
        kg.masked_fill_(hole, 0)
        vg.masked_fill_(hole, 0)
    res = torch_attention(q, kg, vg, scale, causal, start, key_pos=pos.masked_fill(pad, -1),
                          keep=keep)
    if out is None or lse is None:
        return res
    out.copy_(res[0])
    lse.copy_(res[1])
    return out, lse
