"""Weight layouts for the decoder's matmuls on the CPU, chosen per batch size (decode speed).

Decode multiplies a few rows x [B, in] by every weight W [out, in]; on the CPU that is
memory-bound and the layout of W decides how close it runs to the read bandwidth. Measured
on the 2-core development box (SmolLM2-135M's 30 layers of weights, 425 MB fp32, and its
49152 x 576 head, streamed as decode does, torch 2.13 with MKL and oneDNN):

- batch 1 to 8: kvbench's own kernel (probes/gemv.c: each W row read once, in order, with
  the stream prefetched into L2 far ahead, AVX2/FMA) on W [out, in] as it is. Interleaved in
  one sitting (2026-11-27), 8 layers' matmuls (113 MB) and the head (113 MB): batch 1 at
  24 and 28 GB/s, batch 4 at 23 and 28, batch 8 at 17 and 26, where oneDNN's weight packed
  for that batch (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing
  uses) ran at 14-17 and 20-22 GB/s, `F.linear` slower still; the machine's read loop: 35-38
  GB/s. Before its prefetch the kernel ran batch 4 at 13 GB/s, behind oneDNN.
- batch 1 without the native library: x @ W^T with W^T stored [in, out] contiguous (about
  1.7x `F.linear` on W [out, in]);
- batch > 8, or 2 to 8 without the native library: oneDNN's packed weight.

`packed(w, batch, spare)` makes that layout ("native", "t" or "dnn"; None where none
applies: CUDA, dtypes other than float32, oneDNN missing, or no `spare` memory for the
oneDNN copy) and `matmul` uses it. Weights changed after packing need `Decoder.pack` again.
`Linear` is an nn.Linear that packs its own weight: "native" reads the weight as it is;
"t" (batch 1 without the native library) replaces the weight's storage (the parameter
stays an [out, in] view of the [in, out] copy, so no memory is added); the oneDNN copy sits
beside the weight, which strategies (`Decoder.query_weight`) still read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvbench.timing import kernel

Packed = tuple[torch.Tensor, str]  # (weight in its layout, "t" or "dnn")


def packed(w: torch.Tensor, batch: int, spare: bool) -> Packed | None:
    """W [out, in] laid out for x [batch, in] @ W^T on the CPU, or None (keep `F.linear`);
    `spare`: whether memory allows a copy beside W."""
    if w.device.type != "cpu" or w.dtype != torch.float32:
        return None
    from kvbench.kernels import cpu

    w = w.detach()
    if batch <= cpu.MAX_GEMV_ROWS and cpu.gemv_ok(w[:1], w):
        return w, "native"
    if batch == 1:
        return (w.t() if w.t().is_contiguous() else w.t().contiguous()), "t"
    if spare and torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), batch), "dnn"
    return None


def matmul(x: torch.Tensor, p: Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W^T (+ bias) -> [..., out] with W in the layout `p`."""
    w, kind = p
    if kind == "dnn":
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    if kind == "native":
        from kvbench.kernels import cpu

        out = cpu.gemv(x, w) if cpu.gemv_ok(x, w) else F.linear(x, w)
        return out if bias is None else out.add_(bias)
    out = torch.matmul(x, w)
    return out if bias is None else out.add_(bias)


class Linear(nn.Linear):
    """nn.Linear with `pack(batch)`: the layout `packed` picks, used from then on."""

    fast: Packed | None = None

    def pack(self, batch: int, spare: bool) -> None:
        self.fast = packed(self.weight, batch, spare)
        if self.fast is not None and self.fast[1] == "t":
            self.weight.data = self.fast[0].t()  # one storage, [out, in] view

    @kernel
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast is None:
            return F.linear(x, self.weight, self.bias)
        return matmul(x, self.fast, self.bias)
