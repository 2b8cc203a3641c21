"""What a strategy sees of the run: devices, shapes, dtype, and the work counters.

`Counters` is the per-step work trace (issue: model runtime): for every (step, layer) it
accumulates tokens attended, FLOPs and bytes read per device, bytes moved per link and
seconds per phase. Step 0 is the prefill (with every later turn's append in a multi-turn
run), steps 1..G the decode steps (1..turns * G across turns). The trace is stored
as one record per (quantity, where, layer, phase) whose samples are the per-step values,
which is what later issues project onto other hardware. Every call also feeds the run's
stage graph (`graph`, kvbench.runtime.trace: trace version 2), which `kvbench project`
re-times on hardware profiles.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbench.runtime.trace import LAUNCHES, RESOURCES, WAIT_PHASES, TaskLog, dense_work
from kvbench.timing import kernel_ns

if TYPE_CHECKING:
    import torch

    from kvbench.models import ModelSpec
    from kvbench.runtime.breakdown import Metric

# quantity -> unit of its records, for what every strategy's run counts (the shadow counts
# rel_error and topk_recall in eval mode); a strategy's own quantities are declared by the
# `Metric`s of its class (kvbench.runtime.breakdown)
UNITS = {"tokens": "tokens", "flops": "FLOP", "bytes_read": "B", "bytes_moved": "B",
         "time": "s", "rel_error": "ratio", "topk_recall": "ratio"}

# Phases of host work (issuing to a worker or a side stream, joining the worker, gathers on
# the host, the PNM role's CPU work): timed with the host clock on CUDA too, where CUDA
# events on the compute stream would time the stream's gaps instead of the host's work.
HOST_PHASES = frozenset({"bookkeeping.issue", "bookkeeping.handoff", "bookkeeping.predict",
                         "bookkeeping.speculate", "bookkeeping.pnm_select", "pnm.attention"})


class Counters:
    """Work per (quantity, where, layer), one value per step; cheap enough for every step.

    `where` is a device role ("accel", "host", "pnm": the CXL-PNM device role of pnm-kv and
    png-kv) for tokens/flops/bytes_read, a link ("h2d", "d2h", "pnm_reduce") for
    bytes_moved, a phase name ("attention", "bookkeeping", "accel_idle", ...) for time,
    and whatever a strategy's own quantities name (e.g. "recalled"/"evicted" for a page
    strategy's "pages"). `metrics`: the strategy's declared figures (`Strategy.metrics`),
    whose counters it may count besides UNITS' (`unit`).
    """

    def __init__(self, kv_heads: int, elem_bytes: int, cuda: bool = False,
                 n_layers: int = 1, metrics: tuple[Metric, ...] = ()) -> None:
        self.kv_heads = kv_heads
        self.elem_bytes = elem_bytes
        self.cuda = cuda
        self.metrics = metrics
        self._units = {**{m.counter: m.unit for m in metrics}, **UNITS}
        self.step = 0
        self.layer = 0
        self.graph = TaskLog(n_layers)
        self._v: dict[tuple[str, str, int], dict[int, float]] = defaultdict(
            lambda: defaultdict(float))
        self._events: list[tuple[str, int, int, Any, Any, Any]] = []
        self._pairs: list[tuple[Any, Any]] = []  # CUDA event pairs free for reuse
        self._k0 = 0  # kernel clock at the step's start (CPU runs' dispatch account)
        self._excluded = 0.0  # seconds of the step in waits and carried blocks
        self._lazy: list[tuple[dict[Any, Any], Any, Any, float]] = []  # see `add`
        self._after: list[tuple[int, Callable[[], None]]] = []  # see `after_step`

    def add(self, quantity: str, where: str, value: float | torch.Tensor,
            scale: float = 1.0) -> None:
        """Add `value` x `scale` (in `unit(quantity)`) to the current step and layer. A tensor
        value adds its sum, taken at `settle` (no op or sync here: the tensor must not be
        written before the step ends).

        Graph: flops/bytes_read on a device become a "compute" task there (consecutive adds
        merge); time a background "host" task of that many measured seconds."""
        lazy = not isinstance(value, (int, float))
        x = 0.0 if lazy else value * scale
        steps = self._v[(quantity, where, self.layer)]
        steps[self.step] += x
        task = None
        if quantity in ("flops", "bytes_read") and where in RESOURCES:
            task = self.graph.record(self.step, self.layer, where, "compute",
                                     {quantity: x, "launches": 0.0}, merge=True)
        elif quantity == "time" and where not in WAIT_PHASES:
            with self.graph.background():
                task = self.graph.record(self.step, self.layer, "host", where, {"seconds": x})
        if lazy:
            self._lazy.append((steps, self.step, value, scale))
            if task is not None:
                key = "seconds" if quantity == "time" else quantity
                self._lazy.append((task.work, key, value, scale))

    def unit(self, quantity: str) -> str:
        """The unit of counted `quantity`'s records; ValueError for one that is neither
        shared (UNITS) nor the counter of a declared metric: a strategy declares what it
        counts, so no figure reaches the records without a unit and a direction."""
        if quantity not in self._units:
            raise ValueError(f"counted quantity {quantity!r} is undeclared: add a Metric "
                             f"(kvbench.runtime.breakdown) for it to the strategy's `metrics`")
        return self._units[quantity]

    def after_step(self, account: Callable[[], None]) -> None:
        """Run `account` once the step's clock has stopped (`flush`), as of this step: a
        native decode step's record of what its one call did (kvbench.kernels.step: the
        strategies' `decoded`, the layers' work and times), which is kvbench's bookkeeping,
        not the step's work."""
        self._after.append((self.step, account))

    def flush(self) -> None:
        """Run the deferred accounts (`after_step`) in order, each at its own step: at
        `settle` (so at `step_end` and `series`) and before a model's next forward."""
        now = self.step
        while self._after:
            self.step, account = self._after.pop(0)
            account()
        self.step = now

    def settle(self) -> None:
        """Add the tensor values' sums (`add`): one read per device for all of them, at
        `step_end` and `series`, after the step's clock stopped (the deferred accounts
        first: `flush`)."""
        self.flush()
        held: dict[Any, list[tuple[dict[Any, Any], Any, Any, float]]] = defaultdict(list)
        for item in self._lazy:
            held[item[2].device].append(item)
        self._lazy.clear()
        for items in held.values():
            import torch

            sums = torch.stack([t.sum(dtype=torch.float64) for _, _, t, _ in items]).tolist()
            for (holder, key, _, scale), x in zip(items, sums, strict=True):
                holder[key] += x * scale

    def task(self, resource: str, op: str, **work: float) -> None:
        """A task on `resource` with explicit work (kvbench.runtime.trace.WORK names), for
        work no counter describes (a PNM device's scoring, a CXL transfer)."""
        self.graph.record(self.step, self.layer, resource, op, work)

    def fork(self, name: str) -> Any:
        """Context: tasks inside run beside the main chain (see kvbench.runtime.trace)."""
        return self.graph.fork(name)

    def join(self) -> None:
        """The chain waits here for the layer's forks (e.g. before a merge)."""
        self.graph.join()

    def background(self) -> Any:
        """Context: tasks inside are waited for only by the same layer of the next step."""
        return self.graph.background()

    def attended(self, where: str, q: torch.Tensor, n_kv: float) -> None:
        """One attention of q [B, Hq, Lq, D] over n_kv keys per (sequence, KV head) on `where`.

        n_kv may be fractional (the mean over heads when heads attend to different sets).
        FLOPs: 4 * B * Hq * Lq * n_kv * D (q.k and p.v); bytes read: the k and v entries.
        """
        b, hq, lq, d = q.shape
        self.attention(where, b * n_kv, 4.0 * b * hq * lq * n_kv * d,
                       2.0 * b * self.kv_heads * n_kv * d * self.elem_bytes,
                       q.numel() * self.elem_bytes)

    def attention(self, where: str, tokens: float, flops: float, nbytes: float,
                  q_bytes: float = 0.0) -> None:
        """One attention computation with its work given directly (what `attended`
        derives from shapes): tokens, FLOPs, KV bytes read, query bytes (read once,
        the output as many written)."""
        self._v[("tokens", where, self.layer)][self.step] += tokens
        self._v[("flops", where, self.layer)][self.step] += flops
        self._v[("bytes_read", where, self.layer)][self.step] += nbytes
        if where in RESOURCES:
            self.graph.record(self.step, self.layer, where, "attention",
                              {"flops": flops, "bytes_read": nbytes + q_bytes,
                               "bytes_written": q_bytes, "launches": LAUNCHES["attention"]})

    def moved(self, link: str, nbytes: float, ahead: int = 0, copies: int = 1) -> None:
        """Bytes copied over `link` ("h2d" host->accelerator, "d2h" back) in `copies`
        transfers; `ahead` k > 0: a prefetch that layer + k's attention waits for."""
        self._v[("bytes_moved", link, self.layer)][self.step] += nbytes
        self.graph.record(self.step, self.layer, link, "copy",
                          {"bytes_moved": nbytes, "copies": float(copies),
                           "launches": float(copies)}, ahead=ahead)

    def dense(self, spec: ModelSpec, part: str, rows: int) -> None:
        """The decoder's non-attention work of `rows` tokens (trace.dense_work) on the
        accelerator; "post" first joins the layer's forks (its input is the attention
        output)."""
        if part == "post":
            self.graph.join()
        self.graph.record(self.step, self.layer, "accel", part,
                          dense_work(spec, part, rows, self.elem_bytes))

    def elapsed(self, phase: str, seconds: float) -> None:
        """Seconds of `phase` at the current layer timed inside a native call
        (kvbench.kernels.step, whose time is kernel time): recorded as `timed` records a
        block of that many seconds that recorded no work itself (a "host" task, but for a
        wait phase such as "attention", whose work its strategy counts)."""
        with self.carried(phase, seconds):
            pass

    @contextmanager
    def carried(self, phase: str, seconds: float) -> Iterator[None]:
        """`elapsed` for a block whose work the body records (a strategy counting what its
        native call did): as `timed` records it, a "host" task only if the body recorded
        none."""
        n0 = len(self.graph.tasks)
        yield
        self._v[("time", phase, self.layer)][self.step] += seconds
        self._carry(phase, False, n0, seconds)

    @contextmanager
    def timed(self, phase: str, wait: bool = False) -> Iterator[None]:
        """Time the block into ("time", phase): on a GPU with a pair of CUDA events on the
        current stream, taken from a pool and resolved at `step_end`; with perf_counter_ns
        otherwise, and for HOST_PHASES on a GPU too.

        Graph: a block that recorded no modelled work becomes a "host" task of its
        measured seconds, unless it only waits (`wait`, or phase "attention"/"accel_idle")."""
        n0 = len(self.graph.tasks)
        if self.cuda and phase not in HOST_PHASES:
            import torch

            e0, e1 = self._pairs.pop() if self._pairs else (
                torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            e0.record()
            yield
            e1.record()
            task = self._carry(phase, wait, n0, 0.0)
            self._events.append((phase, self.layer, self.step, e0, e1, task))
            return
        t0, k0, x0 = time.perf_counter_ns(), kernel_ns(), self._excluded
        yield
        s = (time.perf_counter_ns() - t0) * 1e-9
        self._v[("time", phase, self.layer)][self.step] += s
        if self._carry(phase, wait, n0, s) is not None or wait or phase == "accel_idle":
            # already in the graph (carried) or a wait: not dispatch (its kernels are
            # subtracted from the step through the kernel clock)
            self._excluded = x0 + s - (kernel_ns() - k0) * 1e-9

    def _carry(self, phase: str, wait: bool, n0: int, seconds: float) -> Any:
        if wait or phase in WAIT_PHASES or len(self.graph.tasks) != n0:
            return None
        return self.graph.record(self.step, self.layer, "host", phase, {"seconds": seconds})

    def step_begin(self) -> None:
        """Open a step's dispatch account (see `step_end`)."""
        self._k0, self._excluded = kernel_ns(), 0.0

    def step_end(self, seconds: float) -> None:
        """Close the step (`seconds`: its wall time). On a CPU run, what kernels
        (kvbench.timing.kernel: matmuls, attention, merges), waits and carried blocks leave
        of it becomes one chained "host" task "dispatch" of that many measured seconds: the
        Python and small torch ops of the decoder and the strategy, which the accelerator
        role shares with them here. On CUDA the host issues asynchronously (no dispatch
        task): the step's event pairs are resolved (`resolve`) and go back to the pool, so
        a run holds the events of one step, not of every step."""
        self.settle()
        if self.cuda:
            self.resolve()
            return
        rest = seconds - (kernel_ns() - self._k0) * 1e-9 - self._excluded
        self.graph.record(self.step, self.layer, "host", "dispatch", {"seconds": max(rest, 0.0)})

    def resolve(self) -> None:
        """Turn recorded CUDA event pairs into seconds (waiting for each end event, at no
        cost after a synchronize) and return the pairs to the pool."""
        for phase, layer, step, e0, e1, task in self._events:
            e1.synchronize()
            s = e0.elapsed_time(e1) * 1e-3
            self._v[("time", phase, layer)][step] += s
            if task is not None:
                task.work["seconds"] = s
            self._pairs.append((e0, e1))
        self._events.clear()

    def series(self) -> Iterator[tuple[str, str, int, dict[int, float]]]:
        """(quantity, where, layer, {step: value}) for everything counted, in stable order."""
        self.settle()
        self.resolve()
        for (quantity, where, layer), steps in sorted(self._v.items()):
            yield quantity, where, layer, dict(steps)

    def step_total(self, quantity: str, where: str, step: int) -> float:
        """Sum over layers of one quantity at one step."""
        self.settle()
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
