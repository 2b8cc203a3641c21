"""Project a run's stage graph onto a larger model shape, batch and context (issue 14).

What runs here is the bundled 135M model at short contexts; what the papers report is
OPT-6.7B..66B or Llama-3.1 at thousands to a million tokens. `scale` rewrites a source
graph as the target would run it, carrying over the strategy's selection statistics:

- layers: target layer l replays source layer floor(l * L_src / L_tgt) (a strategy's dense
  first layers stay first); dependencies are kept by position: (step offset, layer offset,
  index of the task within its layer), falling back to the previous task of the layer,
  and a task left waiting for nothing waits for the last task before it (the chain);
- steps: target decode step j replays source step ceil(j * G_src / G_tgt); its context
  ratio c = (P_tgt + j) / (P_src + s) scales attention and copies;
- dense tasks ("pre", "post", "head"): recomputed for the target spec at the target rows
  (kvbench.runtime.trace.dense_work);
- attention and compute tasks: FLOPs x batch ratio x (Hq D) ratio x c (prefill: x c
  squared, causal queries times keys), bytes read x batch ratio x (Hkv D e) ratio x c;
- copies: KV copies bytes x batch ratio x (Hkv D e) ratio x c; a copy no larger than the
  step's queries plus their outputs and lse (HGCA's query and partial-output transfers)
  moves activations: x batch ratio x (Hq D) ratio; the same transfer count;
- carried seconds (bookkeeping without a work model): as measured, unscaled.

The fraction of the context each strategy attends or moves is thereby the source run's;
every projected record says so (method.scaled_from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvbench.hwmodel.schedule import DENSE
from kvbench.models import ModelSpec
from kvbench.runtime.trace import Task, dense_work


@dataclass(frozen=True)
class Shape:
    """A run's shape: model, batch, prompt, decode steps, element bytes."""

    spec: ModelSpec
    batch: int
    prompt: int
    gen: int
    elem: int


def scale(tasks: list[Task], src: Shape, tgt: Shape) -> list[Task]:
    """The target run's tasks (module docstring), ids renumbered in order."""
    by: dict[tuple[int, int], list[Task]] = {}
    for t in sorted(tasks, key=lambda t: t.id):
        by.setdefault((t.step, t.layer), []).append(t)
    pos = {t.id: (t.step, t.layer, i) for key, ts in by.items() for i, t in enumerate(ts)}
    ls, lt = max(k[1] for k in by) + 1, tgt.spec.n_layers  # the source run's layers
    gs = max(k[0] for k in by)
    out: list[Task] = []
    ids: dict[tuple[int, int, int], int] = {}
    chain: int | None = None  # the last task every later one may fall back to
    for j in range(tgt.gen + 1):
        s = 0 if j == 0 else min(gs, max(1, math.ceil(j * gs / tgt.gen)))
        c = (tgt.prompt + j) / (src.prompt + s)
        for layer in range(lt):
            sl = min(ls - 1, layer * ls // lt)
            for i, t in enumerate(by.get((s, sl), [])):
                new = Task(len(out), j, layer, t.resource, t.op, _work(t, src, tgt, c, j == 0),
                           [], t.background)
                for a in t.after:
                    if a not in pos:
                        continue
                    ps, pl, pi = pos[a]
                    tl = lt - 1 if ps != s and pl == ls - 1 else layer + (pl - sl)
                    key = (j + (ps - s), tl, pi)
                    if key in ids:
                        new.after.append(ids[key])
                    elif i and (j, layer, i - 1) in ids:
                        new.after.append(ids[(j, layer, i - 1)])
                if not new.after and chain is not None:  # e.g. a one-layer source
                    new.after.append(chain)
                if not new.background:
                    chain = new.id
                ids[(j, layer, i)] = new.id
                out.append(new)
    return out


def _work(t: Task, src: Shape, tgt: Shape, c: float, prefill: bool) -> dict[str, float]:
    w = dict(t.work)
    b = tgt.batch / src.batch
    if t.op in DENSE:
        rows = w.get("rows", 1.0) * b * (tgt.prompt / src.prompt if prefill else 1.0)
        if t.op == "head":
            rows = tgt.batch
        return dense_work(tgt.spec, t.op, max(1, round(rows)), tgt.elem)
    if w.get("seconds"):
        return w
    s, g = src.spec, tgt.spec
    kv = (g.n_kv_heads * g.head_dim * tgt.elem) / (s.n_kv_heads * s.head_dim * src.elem)
    qd = (g.n_heads * g.head_dim) / (s.n_heads * s.head_dim)
    cq = c * c if prefill else c
    # a copy no larger than a query plus its output and lse moves activations, not KV
    act = 2.0 * src.batch * s.n_heads * (s.head_dim * src.elem + 4) * (
        src.prompt if prefill else 1)
    moved = b * qd * (c if prefill else 1.0) if w.get("bytes_moved", 0.0) / max(
        w.get("copies", 1.0), 1.0) <= act else b * kv * c
    for k, f in (("flops", b * qd * cq), ("bytes_read", b * kv * c),
                 ("bytes_written", b * qd * (c if prefill else 1.0)),
                 ("bytes_moved", moved)):
        if k in w:
            w[k] *= f
    return w
