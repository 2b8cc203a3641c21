"""The stage graph of a run (trace version 2): per (step, layer) tasks with work and waits.

Issue 14: every prefill, decode and append step is recorded as tasks, each on one resource
with its work and the tasks it waits for, so `kvbench project` can re-time the run on other
hardware (kvbench.hwmodel). Tasks are derived centrally from the counter calls strategies
already make (kvbench.runtime.context.Counters); a strategy only adds a hint where it
overlaps work.

Resources (`RESOURCES`): "accel" (the accelerator's compute stream: FLOPs and bytes read
from its memory), "h2d"/"d2h" (one copy engine per direction), "host" (the host thread
pool: host attention, and measured Python bookkeeping carried over as seconds), "cxl" (a
CXL.mem link), "pnm" (a processing-near-memory device). Work per task: `flops`,
`bytes_read`, `bytes_written`, `bytes_moved` (over a link), `copies` (transfers: the size
of each is bytes_moved / copies), `launches` (kernel launches or op dispatches) and
`seconds` (measured time carried over as is: bookkeeping without a work model) and `rows`
(tokens a dense task multiplies: its matmuls' row count).

Where tasks come from (no strategy edit needed):
    decoder            "dense" accel tasks per layer (norm + q/k/v projection before the
                       strategy, out-projection + MLP after it; "head" after the last
                       layer), work from the model spec (`dense_work`)
    attended(where,..) an "attention" task on "accel", "host" or "pnm" (a near-memory
                       device attending its share: PNM-KV, PnG-KV)
    moved(link, n)     a "copy" task on "h2d"/"d2h"/"cxl" (`copies=` transfers, default 1)
    task(res, op, **w) any other work on a resource (e.g. a PNM device's top-k scoring)
    add("flops"|"bytes_read", where, v)   a "compute" task (consecutive adds merge)
    add("time", phase, s)                 a background "host" task of s measured seconds
    timed(phase)       a "host" task of the block's seconds when no modelled work was
                       recorded inside it ("attention" and "accel_idle" are waits, as is
                       any block timed with `wait=True`)
    step_end(s)        CPU runs: a "host" task "dispatch" closing the step, of the step's
                       wall time less the kernels' (kvbench.timing.kernel: matmuls,
                       attention, merges), the waits' and the carried blocks': the Python
                       and small torch ops of decoder and strategy, measured (projected
                       onto a CPU accelerator as is, dropped on a GPU: kvbench.hwmodel)

Dependencies. By default tasks form one chain in the order they are recorded (what a
single CPU thread does). Hints, for strategies that overlap work:
    with counters.fork("name"):   tasks inside chain among themselves (a fork of the same
                                  name continues within the layer) beside the main chain;
                                  the layer's output (the decoder's post-attention dense
                                  task) waits for them. HGCA: query to the host, host
                                  attention, partial output back, beside the accel window.
    counters.moved(link, n, ahead=k)   a prefetch for layer + k (wrapping into the next
                                  step): issued now, waited for by that layer's first
                                  attention task. Offload (k=1), InfiniGen's speculated
                                  gather (k=1).
    with counters.background():   work nobody in this step waits for (evictions, write-
                                  backs, a worker's selection); the same layer of the next
                                  step waits for it (asynchronous across steps).

A step's first task waits for the previous step's last chain task (the token it feeds).
Stored as one record per step, metric "trace.tasks" (value: the task count; method:
{"trace_version": 2, "columns": COLUMNS, "tasks": [[...], ...]}), task ids global to the
run so that dependencies may point into earlier steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvbench.models import ModelSpec

TRACE_VERSION = 2
RESOURCES = ("accel", "h2d", "d2h", "host", "cxl", "pnm")
WORK = ("flops", "bytes_read", "bytes_written", "bytes_moved", "copies", "launches",
        "seconds", "rows")
COLUMNS = ("id", "layer", "resource", "op", *WORK, "after", "background")
WAIT_PHASES = frozenset({"attention", "accel_idle"})
# op dispatches per dense part of a layer and per attention call: counts of the decoder's
# torch ops (norm, projection, rope, views, residual adds), an estimate the profile's
# per-launch overhead multiplies
LAUNCHES = {"pre": 8, "post": 10, "head": 3, "attention": 3, "copy": 1, "compute": 2}


@dataclass
class Task:
    """One unit of work on one resource; `after` holds the ids it waits for."""

    id: int
    step: int
    layer: int
    resource: str
    op: str
    work: dict[str, float] = field(default_factory=dict)
    after: list[int] = field(default_factory=list)
    background: bool = False

    def row(self) -> list[Any]:
        return [self.id, self.layer, self.resource, self.op,
                *(self.work.get(w, 0.0) for w in WORK), self.after, self.background]


def dense_work(spec: ModelSpec, part: str, rows: int, elem: int) -> dict[str, float]:
    """FLOPs and bytes of the decoder's non-attention work for `rows` = B * T tokens.

    part "pre": norm + fused q/k/v projection; "post": output projection + MLP (+ norms);
    "head": final norm + logits of the last position (rows = B). Weights are read once
    per call; activations in and out once.
    """
    h, d = spec.hidden, spec.head_dim
    qkv = h * (spec.n_heads + 2 * spec.n_kv_heads) * d
    if part == "pre":
        w, n_in, n_out = qkv, h, (spec.n_heads + 2 * spec.n_kv_heads) * d
    elif part == "post":
        w, n_in, n_out = spec.layer_params() - qkv, spec.n_heads * d + h, h
    else:
        w, n_in, n_out = spec.vocab * h, h, spec.vocab
    return {"flops": 2.0 * rows * w, "bytes_read": float((w + rows * n_in) * elem),
            "bytes_written": float(rows * n_out * elem), "launches": float(LAUNCHES[part]),
            "rows": float(rows)}


class TaskLog:
    """Builds the task graph as counters are called; see the module docstring."""

    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers
        self.tasks: list[Task] = []
        self._seq = -1  # index of the current step in run order
        self._key: tuple[int, int] | None = None  # (step, layer) of the last task
        self._chain: list[int] = []  # what the next chain task waits for
        self._forks: dict[str, int] = {}  # fork name -> its last task (this layer)
        self._fork: str | None = None
        self._background = False
        self._joins: list[int] = []  # fork tails the layer's output waits for
        self._ahead: dict[int, list[int]] = {}  # global layer index -> prefetches for it
        self._bg: dict[int, list[int]] = {}  # layer -> background tasks of the last step
        self._bg_next: dict[int, list[int]] = {}
        self._layer_waits: list[int] = []  # background joins for the layer's first task
        self._open = False  # the last task may absorb further add() work

    def _enter(self, step: int, layer: int) -> None:
        if self._key is not None and self._key[0] == step and self._key[1] == layer:
            return
        if self._key is None or self._key[0] != step:
            self._seq += 1
            self._bg, self._bg_next = self._bg_next, {}
        self._key = (step, layer)
        self._forks.clear()
        self._layer_waits = self._bg.pop(layer, [])

    def record(self, step: int, layer: int, resource: str, op: str,
               work: dict[str, float], ahead: int = 0, merge: bool = False) -> Task:
        """Add a task at (step, layer) with the dependencies the current hints give."""
        self._enter(step, layer)
        last = self.tasks[-1] if self.tasks else None
        if merge and self._open and last is not None and last.resource == resource \
                and last.op == op and (last.step, last.layer) == (step, layer):
            for k, v in work.items():
                last.work[k] = last.work.get(k, 0.0) + v
            return last
        t = Task(len(self.tasks), step, layer, resource, op, dict(work))
        g = self._seq * self.n_layers + layer
        if self._fork is not None:
            prev = self._forks.get(self._fork)
            t.after = [prev] if prev is not None else list(self._chain)
            self._forks[self._fork] = t.id
            if prev in self._joins:
                self._joins.remove(prev)
            self._joins.append(t.id)
        else:
            t.after = list(self._chain)
        t.after += self._layer_waits
        self._layer_waits = []
        if op == "attention":
            t.after += self._ahead.pop(g, [])
        if ahead:
            self._ahead.setdefault(g + ahead, []).append(t.id)
        elif self._background:
            t.background = True
            self._bg_next.setdefault(layer, []).append(t.id)
        elif self._fork is None:
            self._chain = [t.id]
        self._open = merge
        self.tasks.append(t)
        return t

    def join(self) -> None:
        """The layer's attention output is complete: the chain waits for every fork."""
        if self._joins:
            self._chain = self._chain + self._joins
            self._joins = []

    @contextmanager
    def fork(self, name: str) -> Iterator[None]:
        outer, self._fork = self._fork, name
        try:
            yield
        finally:
            self._fork = outer

    @contextmanager
    def background(self) -> Iterator[None]:
        outer, self._background = self._background, True
        try:
            yield
        finally:
            self._background = outer

    def steps(self) -> dict[int, list[Task]]:
        """Tasks by step number (a multi-turn run's appends all share step 0)."""
        out: dict[int, list[Task]] = {}
        for t in self.tasks:
            out.setdefault(t.step, []).append(t)
        return out
