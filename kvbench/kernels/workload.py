"""One attention grid point's tensors and the step of each mode (HGCA sections 2.3 and 5.1).

A point holds `gpu_tokens` recent KV positions in device memory and `host_tokens` older
ones in (pinned) host memory, for batch x KV heads x head_dim, and a block of `query` new
tokens at the end. The modes the attention probe times:

- gpu: all positions already on the GPU (the unlimited-memory ideal of Fig. 1);
- gpu-transfer: copy the host part into the GPU's KV buffer, then dense on the GPU (FlexGen);
- cpu-dense / cpu-sparse: the CPU attends over the host part (all, or `keep` of it per head);
- hybrid: GPU dense on its part while the CPU does sparse on its part, then the LSE merge
  (HGCA Algorithm 2). Without CUDA the device part runs on the CPU (params say device=cpu).
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from kvbench.errors import KvbenchError, require
from kvbench.kernels.attention import dense_attention, merge
from kvbench.kernels.cpu import output_buffers
from kvbench.kernels.sparse import pack_indices, sparse_attention
from kvbench.units import dtype_name

if TYPE_CHECKING:
    import torch



@dataclass(frozen=True)
class Point:
    """One grid point; sizes in tokens, dtype by name."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    gpu_tokens: int
    host_tokens: int
    query: int
    dtype: str  # a torch name; fp32/bf16/fp16 become one

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    def check(self) -> None:
        require(self.kv_heads > 0 and self.heads % self.kv_heads == 0,
                f"heads ({self.heads}) must be a multiple of kv heads ({self.kv_heads})")
        require(min(self.batch, self.head_dim, self.query) > 0
                and min(self.gpu_tokens, self.host_tokens) >= 0,
                "batch, head dim and query length must be positive, token counts >= 0")

    def kv_bytes(self, tokens: float) -> float:
        """Bytes of K and V for `tokens` positions of every batch row and KV head."""
        item = 4 if self.dtype == "float32" else 2
        return 2.0 * self.batch * self.kv_heads * tokens * self.head_dim * item

    def params(self) -> dict[str, int | str]:
        return asdict(self)


def torch_dtype(name: str, device: str) -> torch.dtype:
    """The torch dtype for `name`; KvbenchError when `device` cannot compute in it."""
    import torch

    dt = getattr(torch, dtype_name(name))
    try:
        a = torch.ones(2, 2, dtype=dt, device=device)
        (a @ a).sum().item()
    except (RuntimeError, TypeError) as e:
        raise KvbenchError(f"dtype {name} is not supported on {device}: {e}") from None
    return dt


def release_host_cache() -> None:
    """Hand the pinned host blocks that torch's caching host allocator keeps unused back to
    the OS (it caches every freed `pin_memory()` block, rounded up to a power of two, for a
    later request of the same size class); nothing to do without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return
    empty = (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
             or getattr(torch._C, "_host_emptyCache", None))  # older torch
    if empty is not None:
        empty()


def pinned(tensors: list[torch.Tensor], owner: object) -> list[torch.Tensor]:
    """Pinned copies of host `tensors`, held by the returned list alone (keep no other
    reference): when `owner` dies the list is emptied, so the copies are freed, and the
    host cache released, so their blocks go back to the OS rather than stay cached."""
    held = [t.pin_memory() for t in tensors]
    weakref.finalize(owner, _unpin, held).atexit = False  # at exit the OS takes it all
    return held


def _unpin(held: list[torch.Tensor]) -> None:
    held.clear()
    release_host_cache()


class Workload:
    """Tensors of one point: q `[B, H, Lq, D]`, host KV `[B, Hkv, host, D]` (pinned with CUDA),
    the device KV buffer `[B, Hkv, host + gpu, D]` (older host part first), and per-head
    selected host positions for the sparse part (`keep` of host_tokens, per-head counts
    varying by up to +-50% as HGCA's per-head selection does).

    The pinned host KV goes back to the OS with the Workload (`pinned`): the probe measures
    its grid in groups sized to a quarter of the memory free before the first (GPU audit
    finding 17: Fig. 10's 16 x 56 heads x 64K fp16 points hold 30 GB of host KV each), so
    blocks cached from one group would come on top of the next one's."""

    def __init__(self, p: Point, keep: float, threads: int, cuda: bool, seed: int = 0) -> None:
        import torch

        self.p, self.keep, self.threads = p, keep, threads
        self.device = "cuda" if cuda else "cpu"
        dt = torch_dtype(p.dtype, "cpu")
        if cuda:
            torch_dtype(p.dtype, "cuda")
        gen = torch.Generator().manual_seed(seed)
        b, h, hk, d = p.batch, p.heads, p.kv_heads, p.head_dim
        self.q = torch.randn(b, h, p.query, d, generator=gen).to(dt)
        total = p.host_tokens + p.gpu_tokens
        kv = torch.randn(2, b, hk, total, d, generator=gen).to(dt)
        host = [kv[i, :, :, : p.host_tokens].contiguous() for i in (0, 1)]
        self._host = pinned(host, self) if cuda else host  # k, v [B, Hkv, host, D]
        self.k_dev = kv[0].to(self.device)
        self.v_dev = kv[1].to(self.device)
        self.q_dev = self.q.to(self.device)
        self.total = total
        # Per-head selections: counts around keep * host_tokens, sorted positions.
        base = keep * p.host_tokens
        counts = (base * (0.5 + torch.rand(b, hk, generator=gen))).round().clamp(0, p.host_tokens)
        if p.host_tokens:
            counts = counts.clamp_min(1)
        self.lengths = counts.to(torch.int64)
        n = int(self.lengths.max()) if self.lengths.numel() else 0
        order = torch.rand(b, hk, p.host_tokens, generator=gen).argsort(dim=-1)[..., :n]
        self.selection = pack_indices(order.sort(dim=-1).values, b, hk, p.host_tokens,
                                      self.lengths)
        self.out, self.lse = output_buffers(self.q)

    @property
    def k_host(self) -> torch.Tensor:
        return self._host[0]

    @property
    def v_host(self) -> torch.Tensor:
        return self._host[1]

    @property
    def selected(self) -> int:
        """Selected host positions summed over batch and KV heads."""
        return int(self.lengths.sum())

    # Steps (each returns (out, lse) where it attends).
    def transfer(self) -> None:
        p = self.p
        self.k_dev[:, :, : p.host_tokens].copy_(self.k_host, non_blocking=True)
        self.v_dev[:, :, : p.host_tokens].copy_(self.v_host, non_blocking=True)

    def gpu(self) -> tuple[torch.Tensor, torch.Tensor]:
        return dense_attention(self.q_dev, self.k_dev, self.v_dev)

    def gpu_transfer(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.transfer()
        return self.gpu()

    def device_part(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense attention over the recent (device-resident) window, causal at its end."""
        h = self.p.host_tokens
        return dense_attention(self.q_dev, self.k_dev[:, :, h:], self.v_dev[:, :, h:],
                               threads=self.threads)

    def cpu_dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All host positions precede the queries: every one is visible."""
        return dense_attention(self.q, self.k_host, self.v_host, q_start=self.total - self.p.query,
                               threads=self.threads)

    def cpu_sparse(self) -> tuple[torch.Tensor, torch.Tensor]:
        return sparse_attention(self.q, self.k_host, self.v_host, self.selection,
                                q_start=self.total - self.p.query, threads=self.threads,
                                out=self.out, lse=self.lse)

    def sdpa(self) -> torch.Tensor:
        """torch's CPU scaled_dot_product_attention over the host part (the bar's yardstick)."""
        import torch.nn.functional as F

        return F.scaled_dot_product_attention(self.q, self.k_host, self.v_host,
                                              enable_gqa=self.p.heads != self.p.kv_heads)

    def hybrid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Device part queued first (asynchronous on CUDA), CPU sparse meanwhile, then merge."""
        dev = self.device_part()
        host = self.cpu_sparse()
        return merge(dev[0], dev[1], host[0], host[1])
