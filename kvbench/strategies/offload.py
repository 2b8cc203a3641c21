"""FlexGen-style full offload: the whole KV cache on the host, streamed in layer by layer.

Sheng et al., "FlexGen" (HGCA section 5.2 and Fig. 12 baseline, with InfiniGen's set-up
of 100% of the KV starting on the host): each layer's KV lives in host memory (pinned on
CUDA); every decode step copies it to an accelerator staging buffer for dense attention.
The copy of the next layer (the next step's layer 0 after the last layer) is issued before
the current layer's attention so that transfer and compute overlap (FlexGen's schedule):
on CUDA a side stream, pinned buffers and an event per copy; on a CPU-only machine the
"accelerator" is the CPU, the copy is a memcpy on a helper thread, and the bytes are
counted on the h2d link all the same (transfer time is then DRAM time, not PCIe time).

Layout, token-major so that the first n tokens of a layer are one contiguous block (GPU
audit, issue 28, finding 5: a [:, :, :n] slice of a [B, Hkv, max_len, D] buffer is strided,
and ATen stages a strided host <-> device copy through pageable memory, which blocks):
host k/v [max_len, B, Hkv, D] per layer, exactly sized and page-locked on CUDA
(strategies._hostcopy.HostKV), and two accelerator staging buffers of the same shape (for
k and v each) that alternate between calls: one is read by the current layer's attention
(as the view [B, Hkv, n, D]) while the other is filled. The prefill attends over
the prompt where it was computed (the accelerator) and writes it back to the host. An
append (a later turn's prompt, T tokens) runs the decode path with T new tokens: the
layer's host KV is staged in, the new k/v join it there and on the host, and attention is
causal over the new tokens. `accel_idle` records how long the accelerator role waits for
a copy to finish. Fidelity (FMInference/FlexLLMGen 004ffef, `load_cache` path 0, the
overlapped loop; 100% of the KV on the host): docs/fidelity/offload.md.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvbench.strategies import STRATEGIES, Strategy
from kvbench.strategies._hostcopy import HostKV, heads_first, tokens_first, transfer

if TYPE_CHECKING:
    import torch

    from kvbench.runtime.context import RunContext


@STRATEGIES.register
class Offload(Strategy):
    """FlexGen-style: all KV on the host, each layer copied in for dense attention, overlapped."""

    name = "offload"
    version = "2"
    exact = ()  # every token attended: always exact

    @classmethod
    def placement(cls, params: object, ctx: RunContext) -> dict[str, int]:
        """Every layer's KV on the host (all of it a DMA source, pinned on CUDA); two
        one-layer staging buffers (k and v each, the whole cache length) on the accelerator."""
        layer = ctx.batch * ctx.max_len * ctx.spec.kv_bytes_per_token(ctx.elem_bytes, 1)
        host = ctx.n_layers * layer
        return {"accel": 2 * layer, "host": host,
                "pinned": host if ctx.accel.type == "cuda" else 0}

    def __init__(self, params: object, ctx: RunContext) -> None:
        import torch

        super().__init__(params, ctx)
        s = ctx.spec
        shape = (ctx.max_len, ctx.batch, s.n_kv_heads, s.head_dim)  # token-major
        self.cuda = ctx.accel.type == "cuda"
        self.host = HostKV(self.cuda)
        self.hk = [self.host.empty(shape, ctx.dtype) for _ in range(ctx.n_layers)]
        self.hv = [self.host.empty(shape, ctx.dtype) for _ in range(ctx.n_layers)]
        self.sk = [torch.empty(shape, dtype=ctx.dtype, device=ctx.accel) for _ in range(2)]
        self.sv = [torch.empty(shape, dtype=ctx.dtype, device=ctx.accel) for _ in range(2)]
        self.length = [0] * ctx.n_layers
        self.cur = 0  # staging buffer the next decode call reads
        self.pending: Any = None  # CUDA event or Future of the copy into buffer `cur`
        self.stream = torch.cuda.Stream(ctx.accel) if self.cuda else None
        self.copier = None if self.cuda else ThreadPoolExecutor(1, "offload-copy")

    def _prefetch(self, layer: int, buf: int) -> None:
        """Start copying `layer`'s host KV into staging buffer `buf` (async)."""
        import torch

        n = self.length[layer]
        src = (self.hk[layer][:n], self.hv[layer][:n])  # contiguous prefixes
        dst = (self.sk[buf][:n], self.sv[buf][:n])
        # the next layer's attention waits for it (the stage graph's look-ahead)
        self.ctx.counters.moved("h2d", 2 * src[0].numel() * src[0].element_size(), ahead=1)
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())  # buf's last reader is done
            with torch.cuda.stream(self.stream):
                for d, s in zip(dst, src, strict=True):
                    transfer(d, s)
                self.pending = torch.cuda.Event()
                self.pending.record(self.stream)
        else:
            pairs = list(zip(dst, src, strict=True))
            self.pending = self.copier.submit(lambda: [transfer(d, s) for d, s in pairs])

    def _wait(self) -> None:
        """The accelerator waits for the copy into the current buffer (timed as idle)."""
        import torch

        with self.ctx.counters.timed("accel_idle"):
            if isinstance(self.pending, Future):
                self.pending.result()
            elif self.pending is not None:
                torch.cuda.current_stream().wait_event(self.pending)
        self.pending = None

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new k/v [T, B, Hkv, D] (token-major, contiguous) back to the host cache
        (d2h, queued on the current stream before any later prefetch of the layer)."""
        n0, n1 = self.length[layer], self.length[layer] + k.shape[0]
        transfer(self.hk[layer][n0:n1], k)
        transfer(self.hv[layer][n0:n1], v)
        self.ctx.counters.moved("d2h", 2 * k.numel() * k.element_size())
        self.length[layer] = n1

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        from kvbench.kernels.attention import dense_attention

        out, _ = dense_attention(q, k, v)
        self.ctx.counters.attended("accel", q, k.shape[2])
        self._store(layer, tokens_first(k), tokens_first(v))
        if layer == self.ctx.n_layers - 1:  # the first decode step's layer 0
            if self.cuda:
                import torch

                torch.cuda.current_stream().synchronize()  # host copies of the prompt done
            self._prefetch(0, self.cur)
        return out

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """New k/v [B, Hkv, T, D] (decode: T = 1) after the staged host KV; causal attention
        [B, Hq, T, D] of q over the n cached + T new tokens."""
        from kvbench.kernels.attention import dense_attention

        buf, n = self.cur, self.length[layer]
        n1 = n + k.shape[2]
        kt, vt = tokens_first(k), tokens_first(v)
        self._wait()
        self.sk[buf][n:n1], self.sv[buf][n:n1] = kt, vt
        self._store(layer, kt, vt)
        self._prefetch((layer + 1) % self.ctx.n_layers, buf ^ 1)  # overlaps this attention
        out, _ = dense_attention(q, heads_first(self.sk[buf][:n1]),
                                 heads_first(self.sv[buf][:n1]))
        self.ctx.counters.attended("accel", q, n1)
        self.cur = buf ^ 1
        return out

    append = decode  # the same path with T >= 2 new tokens
