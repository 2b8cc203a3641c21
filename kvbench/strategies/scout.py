"""ScoutAttention: layer-ahead host attention with a predicted query, periodic block recall.

Zhang et al., "ScoutAttention" (DAC 2026; spec sheet section 1), Algorithm 1 and sections
3.2-3.4. KV is cut into blocks of S tokens (`--page-size`, alias `--block-size`, default 32)
with Quest min/max key digests on the accelerator (section 3.2, kvbench.strategies._pages).
The host holds every token's K/V; the accelerator holds the digests, the last
`--window-pages` blocks (the current one included; the new token's K/V is written to both)
and a set of C resident full blocks (`--resident-blocks`, 0: budget / S, i.e. the top-k set
chosen after prefill by the prompt's last query). A block leaving the window stays resident
while fewer than C are; otherwise it is host-only until a recall brings it back.

Decode step, layer i (Algorithm 1): `layer_input(i, x)` predicts layer i+1's query from
layer i's normed input with layer i+1's W_q and RoPE at the current position (L4), scores
the digests and takes the top blocks within `--budget-tokens` (default 2048, capped by the
context; sinks and window always in, L5), and sends attention of the *predicted* query over
the selected blocks that are not on the accelerator (L6) to a host worker thread (L7). At
layer i+1 the accelerator attends the selected blocks that are (B_pred & B_gpu, disjoint
from the host's share) with the real query (L9-L10), joins the worker (the wait is
`accel_idle`) and merges by log-sum-exp (L12). The worker runs the native kernel through
ctypes, which releases the GIL (a Python thread beside a long kernel call keeps ~50% of its
solo rate on 2 loaded cores; the wrapper's own Python still needs it). Without a layer ahead
(layer 0 when `--dense-layers 0`) or with `--no-precompute` (Fig. 12's ablation) the real
query selects and the host part runs during the layer's own attention.

Periodic recall (section 3.4): after layer l's attention at every R_l-th step the top C
full blocks by the real query's digest scores become resident: missing ones are copied
host -> accelerator (a side CUDA stream, waited for at that layer's next step; inline on a
CPU-only machine), evicting resident blocks outside that set by `--recall-evict`: lowest
score ("score") or least recently selected ("lru"). R_l comes from `--recall-intervals FILE`
(kvbench.strategies._scout_recall) or `--recall-interval` for every layer; `--calibrate-recall
FILE` runs without recall and writes the intervals for `--tau` at the end of the run.

Open choices, recorded: top-k per KV head by default (`--topk-per kv`: one set per GQA
group, what a resident set and a block-sparse kernel share; "query": per query head), the
first `--dense-layers` (default 2, as Quest) keep all KV on the accelerator, the layer-0
rule (`layer0`), the accelerator's set (`accel_blocks`).
Records: per layer "q_cosine" (predicted vs real query, mean over batch and heads), per step
"cpu_ratio" (host tokens / min(budget, context)); with `--pred-error`, per layer
"pred_error" (||out - out_real|| / ||out_real||, out_real being the layer's output when the
real query selects and attends, i.e. --no-precompute's) and "pred_overlap" (share of the
real query's blocks that the predicted query selected), pages recalled/evicted and their bytes
(link "h2d.recall"), `accel_idle`, worker seconds "host_attention".
Exact setting: a budget covering the context (every block resident, nothing on the host).
Fidelity (no public code; Algorithm 1 line by line, the open choices): docs/fidelity/scout.md.
The parameters and the blocks' storage (layout, the window's slide, a step's store, the
recall and its copy): kvbench.strategies._scout_blocks.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvbench.errors import require
from kvbench.kernels import cpu
from kvbench.runtime.breakdown import Metric
from kvbench.strategies import STRATEGIES, Strategy, position_mask
from kvbench.strategies import _scout_recall as recall_file
from kvbench.strategies._hostcopy import heads_first, to_host
from kvbench.strategies._pages import (
    PAGES,
    attend_selected,
    check_layers,
    page_scores,
    page_tokens,
    select_pages,
)
from kvbench.strategies._scout_blocks import ScoutBlocks, ScoutParams

if TYPE_CHECKING:
    import torch

    from kvbench.runtime.context import Counters, RunContext

@STRATEGIES.register
class Scout(ScoutBlocks, Strategy):
    """ScoutAttention: resident blocks on the accelerator + layer-ahead host attention."""

    name = "scout"
    version = "2"
    params = ScoutParams
    exact = (("budget_tokens", 1 << 20),)  # every block resident and selected
    sparse = (("budget_tokens", 32), ("recall_interval", 1))
    host_reads = (2, "a recall step's (every R_l-th, section 3.4): the blocks the host "
                  "gathers for the accelerator and those it evicts (NaN-filled), a nonzero "
                  "each; the host attention's block ids reach its worker "
                  "without a read on the launching thread")
    metrics = (
        PAGES,
        Metric("cpu_compute_ratio_per_step", "ratio", "lower", "step_mean", of="cpu_ratio",
               per="decode step: tokens attended on the host / budget, mean over the layers "
                   "that report it"),
        Metric("query_cosine", "ratio", "higher", "layer", of="q_cosine",
               random="random weights: the predicted query's cosine is meaningless"),
        Metric("predicted_query_rel_error", "ratio", "lower", "layer", of="pred_error"),
        Metric("predicted_block_overlap", "ratio", "higher", "layer", of="pred_overlap"))

    @classmethod
    def for_run(cls, params: ScoutParams, max_len: int) -> tuple[ScoutParams, list[str]]:
        """Record the mean interval in use (the file's, or --recall-interval)."""
        if params.calibrate_recall or not params.recall:
            return replace(params, interval_mean=0.0), []
        mean = (recall_file.mean_interval(params.recall_intervals) if params.recall_intervals
                else float(params.recall_interval))
        return replace(params, interval_mean=mean), []

    @classmethod
    def kv_placement(cls, params: ScoutParams, kv_bytes: int) -> dict[str, int]:
        # the accelerator buffer is allocated whole (position-indexed), plus digests (1/S)
        return {"accel": kv_bytes + -(-kv_bytes // params.page_size), "host": kv_bytes}

    @classmethod
    def placement(cls, params: ScoutParams, ctx: RunContext) -> dict[str, int]:
        """`kv_placement` on the accelerator; on the host the sparse layers' k/v and the
        recall staging k/v [B * Hkv * C' * S, D] ("pinned": all of it, on CUDA)."""
        out = super().placement(params, ctx)
        sparse = max(ctx.n_layers - params.dense_layers, 0)
        token = ctx.batch * ctx.spec.kv_bytes_per_token(ctx.elem_bytes, 1)  # k and v
        stage = cls.recall_most(params, ctx.max_len) * params.page_size if sparse else 0
        host = token * (sparse * ctx.max_len + stage)
        out["host"] = host
        out["pinned"] = host if ctx.accel.type == "cuda" else 0
        return out

    def __init__(self, params: ScoutParams, ctx: RunContext) -> None:
        params, _ = self.for_run(params, ctx.max_len)
        super().__init__(params, ctx)
        check_layers(params.dense_layers, ctx.n_layers)
        require(not (params.calibrate_recall and getattr(ctx.model, "random_weights", False)),
                "--calibrate-recall needs trained weights: with random weights the predicted "
                "query's cosine and the block ranking are meaningless (pass --weights)")
        L, s = ctx.n_layers, ctx.spec
        self.r = [0 if i < params.dense_layers else params.recall_interval for i in range(L)]
        if params.recall_intervals:
            self.r = recall_file.load(params.recall_intervals, s.name, L)
        self._init_blocks(params, ctx)
        self.length = [0] * L
        self.step = 0
        self.worker = ThreadPoolExecutor(  # CPU-only: the host part on its thread alone
            max_workers=1, thread_name_prefix="scout-host",
            initializer=None if self.stream is not None else cpu.helper_thread)
        # layer -> (selected blocks [B, H, K], on-accelerator mask, host job, host tokens,
        # predicted query or None)
        self.pending: dict[int, tuple[Any, ...]] = {}
        self.last: dict[int, torch.Tensor] = {}  # layer -> blocks selected at its last decode
        # calibration: per layer and step, the cpu ratio (0-dim tensors, read at the end)
        self.ratios: list[list[torch.Tensor]] = [[] for _ in range(L)]

    def begin_step(self, step: int) -> None:
        self.step = step

    def attended(self, layer: int) -> torch.Tensor | None:
        import torch

        n, hq = self.length[layer], self.ctx.spec.n_heads
        pages = self.last.get(layer)
        if pages is None:
            return torch.ones(self.ctx.batch, hq, n, dtype=torch.bool, device=self.ctx.accel)
        pos, lens = page_tokens(pages, self.p.page_size, n)
        return position_mask(pos, n, hq, lens)

    def _issue(self, layer: int, q: torch.Tensor, n_tot: int) -> tuple:
        """Select blocks with q [B, Hq, 1, D] over n_tot tokens (Alg. 1 L5) and start the
        host's attention over the selected blocks not on the accelerator (L6-L7).
        Returns (blocks [B, H, K], on-accelerator mask [B, H, K], job, host tokens: their
        mean per row, a 0-dim tensor counted at the step's end). This thread reads no
        device value: the query and the host's block ids go to the host without blocking
        (pinned, then an event on CUDA), as the paper's GPU sends its CPU the blocks to
        attend; the worker waits for them, lists their tokens and returns None where no row
        holds one (`_host`). Every host block is whole: the partial one is the window's."""

        p, c = self.p, self.ctx.counters
        self._slide(layer, n_tot)
        n_pages = -(-n_tot // p.page_size)
        dig = self.dig[layer]
        scores = page_scores(q, dig.lo[:, :, :n_pages], dig.hi[:, :, :n_pages], p.topk_per)
        c.add("bytes_read", "accel", dig.nbytes(n_tot))
        pages = select_pages(scores, n_pages, p.budget_tokens // p.page_size, p.sinks,
                             p.window_pages)
        b, h, _ = pages.shape
        hkv = self.res[layer].shape[1]
        self.used[layer].scatter_(2, pages.reshape(b, hkv, -1), float(self.step))
        res = self.res[layer].repeat_interleave(h // hkv, dim=1)
        on = res.gather(2, pages) | (pages >= self.win[layer])
        (qh, blocks), landed = to_host(self.ctx.host, q,
                                       pages.masked_fill(on, n_pages))  # n_pages: none
        c.moved("d2h", 1.0 * qh.numel() * self.ctx.elem_bytes
                + 1.0 * blocks.numel() * blocks.element_size())
        job = self.worker.submit(self._host, layer, qh, blocks, n_tot - 1, landed,
                                 self.stored.get(layer))
        return pages, on, job, (~on).sum(-1).float().mean() * p.page_size

    def _host(self, layer: int, q: torch.Tensor, blocks: torch.Tensor, n: int, landed: Any,
              stored: Any) -> tuple[torch.Tensor, torch.Tensor, float, Counters] | None:
        """Worker: attention of q over the tokens of the host's blocks [B, H, K] (ids of
        whole blocks below the window; the number of blocks: none) once the event `landed`
        says q and the ids have reached the host and `stored` that the layer's first n
        tokens have (both D2H); None where no row holds a host block. Own counters (merged
        at the join, where the step and layer are the main thread's)."""
        from kvbench.runtime.context import Counters

        if landed is not None:
            landed.synchronize()
        pos, lens = page_tokens(blocks, self.p.page_size, n)  # host memory, this thread
        if not bool(lens.any()):
            return None
        if stored is not None:
            stored.synchronize()
        c = Counters(self.ctx.counters.kv_heads, self.ctx.elem_bytes)
        t0 = time.perf_counter()
        out, lse = attend_selected(q, heads_first(self.host_k[layer][:n]),
                                   heads_first(self.host_v[layer][:n]), pos, lens, c, "host")
        seconds = time.perf_counter() - t0
        c.settle()  # its counts of the host's lens read here, not on the launching thread
        return out, lse, seconds, c

    # -- the strategy calls -------------------------------------------------------------------

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """Dense causal attention; K/V to the accelerator (and host); resident set = the top
        C full blocks below the window by the prompt's last query (per KV head)."""
        from kvbench.kernels.attention import dense_attention

        out, _ = dense_attention(q, k, v)
        c, n = self.ctx.counters, k.shape[2]
        c.attended("accel", q, n)
        self.acc_k[layer][:, :, :n], self.acc_v[layer][:, :, :n] = k, v
        self.length[layer] = n
        if layer < self.p.dense_layers:
            return out
        self._store(layer, 0, k, v)
        dig = self.dig[layer]
        dig.update(self.acc_k[layer], 0, n)
        ws = max(-(-n // self.p.page_size) - self.p.window_pages, 0)
        self.win[layer] = ws
        if ws:
            scores = page_scores(q[:, :, -1:], dig.lo[:, :, :ws], dig.hi[:, :, :ws], "kv",
                                 append=True)
            top = scores.topk(min(self.p.resident, ws), dim=-1).indices
            self.res[layer][:, :, :ws].scatter_(2, top, True)
            self._evict(layer, ~self.res[layer][:, :, :ws])
        return out

    def layer_input(self, layer: int, x: torch.Tensor) -> None:
        """Decode, layer i: predict layer i+1's query (L4) and start its host part."""
        nxt = layer + 1
        if x.shape[1] != 1 or nxt >= self.ctx.n_layers or nxt < self.p.dense_layers \
                or not self.p.precompute:
            return
        with self.ctx.counters.timed("bookkeeping.predict"):
            n = self.length[nxt]  # the current token's position
            q = self.ctx.model.query(nxt, x, n)  # [B, Hq, 1, D]
            self.pending[nxt] = (*self._issue(nxt, q, n + 1), q)

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Accelerator part over the selected resident/window blocks with the real query
        (L9-L10), host part joined and merged by lse (L12); then the layer's recall."""
        import torch
        import torch.nn.functional as F

        from kvbench.kernels.attention import dense_attention, merge

        p, c = self.p, self.ctx.counters
        n = self.length[layer]
        n_tot = self.length[layer] = n + 1
        self.acc_k[layer][:, :, n], self.acc_v[layer][:, :, n] = k[:, :, 0], v[:, :, 0]
        if layer < p.dense_layers:
            self.last.pop(layer, None)
            c.attended("accel", q, n_tot)
            out = dense_attention(q, self.acc_k[layer][:, :, :n_tot],
                                  self.acc_v[layer][:, :, :n_tot], causal=False)[0]
            self._finish(layer, n_tot)
            return out
        self.dig[layer].update(self.acc_k[layer], n, n_tot)
        pending = self.pending.pop(layer, None)
        pages, on, job, host_tokens, q_pred = pending or (*self._issue(layer, q, n_tot), None)
        self._store(layer, n, k, v)  # after the host job took its event: it reads < n
        if layer in self.recalling:  # last step's recall copy must have landed
            with c.timed("accel_idle"):
                torch.cuda.current_stream().wait_event(self.recalling.pop(layer))
        n_pages = -(-n_tot // p.page_size)
        pos, lens = page_tokens(pages.masked_fill(~on, n_pages), p.page_size, n_tot)
        # the stage graph (kvbench project): the accelerator's part and the host's are two
        # forks of the layer, neither waiting for the other (Fig. 4); the merge joins them
        with c.fork("resident"):
            out, lse = attend_selected(q, self.acc_k[layer][:, :, :n_tot],
                                       self.acc_v[layer][:, :, :n_tot], pos, lens, c)
        with c.timed("accel_idle"):
            got = job.result()
        if got is not None:
            out_h, lse_h, seconds, private = got
            with c.fork("host"):
                for quantity, where, _, steps in private.series():
                    c.add(quantity, where, sum(steps.values()))
                c.moved("h2d", 1.0 * out_h.numel() * self.ctx.elem_bytes
                        + 4.0 * lse_h.numel())
            c.add("time", "host_attention", seconds)
        c.join()
        if got is not None:
            with c.timed("bookkeeping.merge"):
                out = merge(out, lse, out_h, lse_h)[0]
        ratio = host_tokens / min(p.budget_tokens, n_tot)
        c.add("cpu_ratio", "host", ratio)  # read at the step's end: no sync
        if p.calibrate_recall:  # the intervals' file, written after the last step
            self.ratios[layer].append(ratio)
        if q_pred is not None:
            cos = F.cosine_similarity(q_pred.float(), q.float(), dim=-1)  # [B, Hq, 1]
            c.add("q_cosine", "predicted", cos.mean())  # read at the step's end: no sync
            if p.pred_error:
                self._pred_error(layer, q, pages, out, n_tot)
        self.last[layer] = pages
        if p.recall and not p.calibrate_recall and self.r[layer] \
                and self.step % self.r[layer] == 0:
            self._recall(layer, q)
        self._finish(layer, n_tot)
        return out

    def _pred_error(self, layer: int, q: torch.Tensor, pages: torch.Tensor,
                    out: torch.Tensor, n_tot: int) -> None:
        """--pred-error: the output the real query q would give (it selects, and every
        selected block is attended from the host's full copy: --no-precompute's output,
        whose accelerator/host split merges to the same attention) against this layer's
        out; counts "pred_error" (relative Frobenius error) and "pred_overlap" (share of
        the real selection the predicted pages [B, H, K] hit)."""
        import torch

        from kvbench.runtime.context import Counters

        p, host = self.p, self.ctx.host
        n_pages = -(-n_tot // p.page_size)
        dig = self.dig[layer]
        scores = page_scores(q, dig.lo[:, :, :n_pages], dig.hi[:, :, :n_pages], p.topk_per)
        real = select_pages(scores, n_pages, p.budget_tokens // p.page_size, p.sinks,
                            p.window_pages)
        pos, lens = page_tokens(real, p.page_size, n_tot)
        private = Counters(self.ctx.counters.kv_heads, self.ctx.elem_bytes)
        self._landed(layer)
        ref, _ = attend_selected(q.to(host), heads_first(self.host_k[layer][:n_tot]),
                                 heads_first(self.host_v[layer][:n_tot]), pos.to(host),
                                 lens.to(host), private, "host")
        ref = ref.to(out.device).float()
        err = torch.linalg.vector_norm((out.float() - ref).flatten())
        norm = torch.linalg.vector_norm(ref.flatten()).clamp_min(1e-30)
        c = self.ctx.counters
        c.add("pred_error", "predicted", err / norm)  # read at the step's end
        hit = torch.zeros(*real.shape[:2], n_pages, dtype=torch.bool, device=real.device)
        hit.scatter_(2, pages, True)
        c.add("pred_overlap", "predicted", hit.gather(2, real).float().mean())

    def _finish(self, layer: int, n_tot: int) -> None:
        """Calibration: after the run's last decode step, write the intervals."""
        import torch

        p = self.p
        if p.calibrate_recall and layer == self.ctx.n_layers - 1 \
                and n_tot == self.ctx.max_len - 1:
            ratios = [torch.stack(rs).tolist() if rs else [] for rs in self.ratios]
            recall_file.write(p.calibrate_recall, self.ctx.spec.name, ratios, p.tau,
                              p.page_size, p.budget_tokens)
