"""In-step matmul rate against the roofline probe's linear rate on this machine (notes.md).

For batch 1 and 8, twice each, this measures three rates:
- the probe's single MLP-up shape, cycled over 256 MiB;
- a layer's four shapes in order, cycled the same way;
- a decode step of the random-weight SmolLM2-135M with attention skipped. Its matmuls'
  own time comes from kvbench.timing.kernel_ns, and the rate is weight bytes over that
  time.

Run it under `chrt -f 10`. The output is in insitu-matmul.txt.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvbench.models import get_spec
from kvbench.models.linear import Linear
from kvbench.models.weights import load
from kvbench.runtime.context import Counters
from kvbench.timing import kernel_ns


class Skip:
    """A strategy that returns the query as the attention output (no attention work)."""

    def begin_step(self, step: int) -> None:
        pass

    def layer_input(self, layer: int, x: torch.Tensor) -> None:
        pass

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        return q

    decode = append = prefill


def rate(shapes: list[tuple[int, int]], rows: int) -> float:
    """GB/s of weights streamed by Linears of `shapes` (in order), cycled over 256 MiB."""
    one = sum(i * o for i, o in shapes) * 4
    lins = [Linear(i, o, bias=False) for _ in range(-(-(256 << 20) // one)) for i, o in shapes]
    for lin in lins:
        lin.pack(rows, True)
    xs = {i: torch.randn(rows, i) for i, _ in shapes}

    def run() -> None:
        with torch.inference_mode():
            for lin in lins:
                lin(xs[lin.in_features])

    run()
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t0)
    return one * (len(lins) // len(shapes)) / statistics.median(ts) / 1e9


def main() -> None:
    torch.set_num_threads(2)
    spec = get_spec("smollm2-135m")
    h, q = spec.hidden, spec.n_heads * spec.head_dim
    mixed = [(h, q + 2 * spec.n_kv_heads * spec.head_dim), (q, h), (h, 2 * spec.ffn),
             (spec.ffn, h)]
    m = load(spec, "random", 30, torch.float32, torch.device("cpu")).model
    weights = sum(p.numel() * 4 for n, p in m.named_parameters()
                  if "norm" not in n and "embed" not in n) + spec.vocab * h * 4
    for rows in (1, 8):
        for _ in range(2):
            m.setup(Skip(), Counters(spec.n_kv_heads, 4, False, 30), 512)
            tok = torch.zeros(rows, 1, dtype=torch.long)
            for _ in range(3):
                m(tok, 100)
            kern, wall = [], []
            for _ in range(10):
                k0, t0 = kernel_ns(), time.perf_counter()
                m(tok, 100)
                wall.append(time.perf_counter() - t0)
                kern.append((kernel_ns() - k0) * 1e-9)
            step = weights / statistics.median(kern) / 1e9
            print(f"rows {rows}: single {rate([(h, spec.ffn)], rows):.2f}  mixed "
                  f"{rate(mixed, rows):.2f}  in-step matmuls {step:.2f} GB/s (step "
                  f"{statistics.median(wall) * 1e3:.1f} ms, matmuls "
                  f"{statistics.median(kern) * 1e3:.1f} ms)", flush=True)


if __name__ == "__main__":
    main()
