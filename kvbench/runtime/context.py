"""What a strategy sees of the run: devices, shapes, dtype, and the work counters.

`Counters` is the per-step work trace (issue: model runtime): for every (step, layer) it
accumulates tokens attended, FLOPs and bytes read per device, bytes moved per link and
seconds per phase. Step 0 is the prefill (with every later turn's append in a multi-turn
run), steps 1..G the decode steps (1..turns * G across turns). The trace is stored
as one record per (quantity, where, layer, phase) whose samples are the per-step values,
which is what later issues project onto other hardware.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kvbench.models import ModelSpec

# quantity -> unit of its records
UNITS = {"tokens": "tokens", "flops": "FLOP", "bytes_read": "B", "bytes_moved": "B",
         "time": "s", "rel_error": "ratio", "pages": "pages",
         "topk_recall": "ratio", "topk_sorts": "sorts", "topk_candidates": "pages",
         "reductions": "messages", "device_load": "B"}


class Counters:
    """Work per (quantity, where, layer), one value per step; cheap enough for every step.

    `where` is a device role ("accel", "host", "pnm": the CXL-PNM device role of pnm-kv and
    png-kv) for tokens/flops/bytes_read, a link ("h2d", "d2h", "pnm_reduce") for
    bytes_moved, a phase name ("attention", "bookkeeping", "accel_idle", ...) for time,
    "recalled"/"evicted" for pages (page strategies: pages moved into or out of the
    accelerator's resident set, summed over batch rows and KV heads), "pnm" for the PNM
    roles' topk_sorts/topk_candidates/reductions and "pnmK" for device K's device_load.
    """

    def __init__(self, kv_heads: int, elem_bytes: int, cuda: bool = False) -> None:
        self.kv_heads = kv_heads
        self.elem_bytes = elem_bytes
        self.cuda = cuda
        self.step = 0
        self.layer = 0
        self._v: dict[tuple[str, str, int], dict[int, float]] = defaultdict(
            lambda: defaultdict(float))
        self._events: list[tuple[str, int, int, Any, Any]] = []

    def add(self, quantity: str, where: str, value: float) -> None:
        """Add `value` (in UNITS[quantity]) to the current step and layer."""
        self._v[(quantity, where, self.layer)][self.step] += value

    def attended(self, where: str, q: torch.Tensor, n_kv: float) -> None:
        """One attention of q [B, Hq, Lq, D] over n_kv keys per (sequence, KV head) on `where`.

        n_kv may be fractional (the mean over heads when heads attend to different sets).
        FLOPs: 4 * B * Hq * Lq * n_kv * D (q.k and p.v); bytes read: the k and v entries.
        """
        b, hq, lq, d = q.shape
        self.add("tokens", where, b * n_kv)
        self.add("flops", where, 4.0 * b * hq * lq * n_kv * d)
        self.add("bytes_read", where, 2.0 * b * self.kv_heads * n_kv * d * self.elem_bytes)

    def moved(self, link: str, nbytes: float) -> None:
        """Bytes copied over `link` ("h2d" host->accelerator, "d2h" back)."""
        self.add("bytes_moved", link, nbytes)

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Time the block into ("time", phase): CUDA events on a GPU, perf_counter otherwise."""
        if self.cuda:
            import torch

            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            yield
            e1.record()
            self._events.append((phase, self.layer, self.step, e0, e1))
            return
        t0 = time.perf_counter_ns()
        yield
        self.add("time", phase, (time.perf_counter_ns() - t0) * 1e-9)

    def resolve(self) -> None:
        """Turn recorded CUDA event pairs into seconds (call after a synchronize)."""
        for phase, layer, step, e0, e1 in self._events:
            self._v[("time", phase, layer)][step] += e0.elapsed_time(e1) * 1e-3
        self._events.clear()

    def series(self) -> Iterator[tuple[str, str, int, dict[int, float]]]:
        """(quantity, where, layer, {step: value}) for everything counted, in stable order."""
        self.resolve()
        for (quantity, where, layer), steps in sorted(self._v.items()):
            yield quantity, where, layer, dict(steps)

    def step_total(self, quantity: str, where: str, step: int) -> float:
        """Sum over layers of one quantity at one step."""
        return sum(s.get(step, 0.0) for (qn, w, _), s in self._v.items()
                   if qn == quantity and w == where)


@dataclass
class RunContext:
    """The run as a strategy sees it. `accel` is cuda when present, else cpu; `host` is cpu."""

    spec: ModelSpec
    n_layers: int
    batch: int
    max_len: int
    dtype: torch.dtype
    accel: torch.device
    host: torch.device
    counters: Counters
    model: Any = field(default=None, repr=False)

    @property
    def elem_bytes(self) -> int:
        return self.dtype.itemsize
