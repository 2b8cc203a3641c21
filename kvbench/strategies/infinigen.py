"""InfiniGen: speculate layer i+1's attention with partial weights, prefetch only its tokens.

Lee et al., "InfiniGen: Efficient Generative Inference of Large Language Models with
Dynamic KV Cache Management" (OSDI 2024, section 4): the full KV lives in host memory; the
accelerator keeps a *partial* key cache of a few skewed channels per KV head. While layer i
runs, layer i+1's query is predicted from layer i's normed input with layer i+1's query
weights (RoPE at the current position), its partial scores against the partial keys pick
the tokens whose score is within `--alpha` of a maximum (default 5, the Llama setting; 4
for OPT); n' = the mean count over batch and heads, capped, the same n' for every head,
and each head's top n' tokens are gathered on the host and copied to the accelerator,
where layer i+1 attends them. The first `--dense-layers` (default 2) layers read their
whole cache from the host each step.

Fidelity (docs/fidelity/infinigen.md; snu-comparch/InfiniGen at 3754f52, files
accuracy/setup/gen_llama_skewing_matrix.py, gen_partial_weight.py,
accuracy/src/modeling_llama_ours.py, accuracy/perplexity/llama.py). `--variant`:
- `authors` (default), the Llama accuracy code: per layer and KV head an orthogonal A (SVD
  of the post-RoPE queries) and the partial channels (the union of the int(r * D) top
  query and top key channels of sum |x A|) calibrated offline, once per (weights, text,
  ratio) and cached (kvbench.strategies._infinigen_calib), on a fixed text shipped with
  kvbench or `--calib-text`, never the scored prompt (a run whose scored text begins with
  it is refused); every head thresholded at head 0's maximum; the current token ranked
  with the cached ones (its partial score counted in the mean and the maximum, attended
  only if in the top n'); cap n' <= 0.2 of the window (`--budget-tokens`, default 0.2 x
  the run's sequence length), and steps before the cap is reached attend densely.
- `oracle`: A and d' = floor(r * D) query channels from the first `--skew-tokens` queries
  of the scored prompt itself (dense until a layer has them): an in-distribution
  calibration no deployment has; per-head maxima (`--max-per head0`: head 0's); the
  current token always attended besides n' <= 0.2 of the cached tokens.
GQA (the authors' code has none): one A and channel set per KV head from its group's
queries, the selection per query head. The rest of the table: the fidelity page.

Exact setting: `--alpha inf` and a budget covering the context (every token attended; for
`authors` the steps then attend densely, as the authors' rows below the cap do).
Multi-turn appends are not defined by InfiniGen: `--turns` > 1 is refused.
Layout per layer: host k/v token-major [max_len, B, Hkv, D] (a prefix is one contiguous
block: stores and whole-cache reads are single DMA copies), partial keys [B, Hkv, max_len,
w] (w = d', or the widest channel union), A [Hkv, D, D] and channel ids [Hkv, w] on the
accelerator. Two gather staging buffers [B * Hq * n'_max, D] (k and v each) and the
speculation's token ids [B, Hq, n'_max] and count are host DMA buffers; all host buffers
are exactly sized and pinned on CUDA (strategies._hostcopy, GPU audit findings 3 and 6).
They and their writes live in strategies._infinigen_cache (InfiniGenCache, the base class),
with the accelerator's landing buffers: a dense layer's whole k/v, and on a CPU-only run the
prefetched tokens' (no buffer allocated per step). A sparse layer attends the fetched tokens
and the new one as two parts merged by their log-sum-exp (the new token's part is one key),
not a concatenation (a copy of the fetched set); the speculation's top n'_max runs natively
on the CPU (kvbench.kernels.cpu.topk, backend "native-topk").

Schedule of a decode step on CUDA (GPU audit finding 10): at layer i's input the
speculation for layer i+1 is queued (partial scores, top n'_max ids, their D2H into the
pinned id buffer and an event); layer i's attention is queued next, and only then does the
host wait for the ids, gather the tokens into a staging buffer and queue their H2D on a
side stream, while the GPU runs layer i. `authors` gathers one token more per head than
the cached mean allows (the current token's key, which may push one out, is not known
yet) and masks on the accelerator. The gather reads host KV that earlier steps' D2H
stores wrote: it waits for the layer's last store event first (finding 15), and a staging
buffer is rewritten only after the H2D that last read it is done.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbench.errors import require
from kvbench.strategies import (
    STRATEGIES,
    position_mask,
)
from kvbench.strategies._hostcopy import transfer
from kvbench.strategies._infinigen_cache import InfiniGenCache, InfiniGenParams
from kvbench.strategies._pages import attend_selected, count_selected

if TYPE_CHECKING:
    import torch



@STRATEGIES.register
class InfiniGen(InfiniGenCache):
    """InfiniGen: layer-ahead speculation with partial weights, prefetch of selected tokens."""

    name = "infinigen"
    version = "3"
    params = InfiniGenParams
    # every token attended (authors: densely, a cap covering the context)
    exact = (("alpha", float("inf")), ("budget_tokens", 1 << 20))
    sparse = (("budget_tokens", 16),)
    host_reads = (1, "the number of tokens the speculation selects, which sizes the prefetch "
                  "from host memory (the authors' code reads it too)")

    def attended(self, layer: int) -> torch.Tensor | None:
        import torch

        n, b, hq = self.length[layer], self.ctx.batch, self.ctx.spec.n_heads
        idx = self.chosen.get(layer)
        if idx is None:
            return torch.ones(b, hq, n, dtype=torch.bool, device=self.ctx.accel)
        if self.p.variant == "authors":
            pos, lens = self.kept[layer]
            return position_mask(pos, n, hq, lens)
        new = torch.full((b, hq, 1), n - 1, dtype=idx.dtype, device=idx.device)
        return position_mask(torch.cat([idx, new], dim=2), n, hq)

    def begin_step(self, step: int) -> None:
        """authors: after the prefill (outside the timed steps), refuse a scored prompt whose
        layer-0 keys are the calibration text's (the skew would be an oracle)."""
        if step >= 1 and self.same is not None:
            same, self.same = bool(self.same), None
            require(not same, "infinigen --variant authors: the scored text begins with the "
                    "calibration text; pass another --calib-text (or --variant oracle)")

    def prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> torch.Tensor:
        """Dense causal attention; KV to the host, skewing from this prompt, partial keys."""
        from kvbench.kernels.attention import dense_attention

        out, _ = dense_attention(q, k, v)
        self.ctx.counters.attended("accel", q, k.shape[2])
        if layer == 0 and self.k0 is not None:  # read at begin_step, not here (no sync)
            m = min(self.k0.shape[1], k.shape[2])
            ref = self.k0[:, :m]
            self.same = (k[0, :, :m].float() - ref).abs().amax() <= 0.02 * ref.abs().amax()
        self._store(layer, k, v)
        self._warm(layer, q, k)
        return out

    def layer_input(self, layer: int, x: torch.Tensor) -> None:
        """During a decode step at layer i: queue the speculation of layer i+1 (its top
        n'_max token ids per head and their count, copied to pinned host buffers); the
        gather and prefetch follow layer i's attention (`_prefetch`)."""
        import torch

        from kvbench.kernels import cpu
        from kvbench.kernels.attention import note_backend

        nxt = layer + 1
        if x.shape[1] != 1 or nxt >= self.ctx.n_layers or nxt < self.p.dense_layers \
                or self.skew[nxt] is None:
            return
        p, counters = self.p, self.ctx.counters
        n = self.length[nxt]  # the current token's position (not yet cached at layer i+1)
        cap = self.cap(n)
        authors = p.variant == "authors"
        if authors and n < cap:  # the authors' rows below the cap attend every token
            return
        with counters.timed("bookkeeping.speculate"):
            q = self.ctx.model.query(nxt, x, n)  # [B, Hq, 1, D]
            b, hq, _, d = q.shape
            hkv, w = self.part[nxt].shape[1], self.part[nxt].shape[3]
            g = hq // hkv
            pq = self._partial(nxt, q, query=True)  # [B, Hq, 1, w]
            pk = self.part[nxt][:, :, :n].float()  # [B, Hkv, n, w], read once for its group
            # a KV group's g query heads in one matmul, [B, Hkv, g, n] (the partial keys
            # repeated per query head cost 2.3 ms a layer at 4 x 3 x 8000 x 12, 0.2 this)
            logits = torch.matmul(pq.reshape(b, hkv, g, w),
                                  pk.transpose(-1, -2)).view(b, hq, n) * d ** -0.5
            top = logits.amax(-1, keepdim=True)
            if authors or p.max_per == "head0":
                top = top[:, :1].expand_as(top)
            count = (logits >= top - p.alpha).sum(-1).float().mean()
            most = min(cap, n)
            if cpu.topk_ok(logits, most):  # [B, Hq, n'_max], best first
                vals, idx = cpu.topk(logits, most)
                note_backend("native-topk", pq)
            else:
                vals, idx = logits.topk(most, dim=-1)
            note_backend("torch-select", pq)
            if authors:
                self.scores[nxt] = (pq, logits, vals, top[:, :1, 0])
            transfer(self.ids[:idx.numel()], idx.flatten())
            transfer(self.count, count.reshape(1))
            ev = None
            if self.stream is not None:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream())
            counters.add("flops", "accel", 2.0 * b * hq * n * w)
            counters.add("bytes_read", "accel", 1.0 * b * hkv * n * w * self.ctx.elem_bytes)
        self.queued = (nxt, idx, cap, n, ev)

    def _prefetch(self, layer: int) -> None:
        """After layer i's attention is queued: gather the tokens speculated for layer
        i + 1 on the host (top n' = max(1, min(count, cap, n)) per head; authors: count + 1,
        the current token may take one place or none) into a staging buffer and queue
        their H2D (a side stream and an event on CUDA)."""
        import torch

        if self.queued is None or self.queued[0] != layer + 1:
            return
        nxt, idx, cap, n, ev = self.queued
        self.queued = None
        counters = self.ctx.counters
        with counters.timed("bookkeeping.speculate"):
            if ev is not None:
                ev.synchronize()  # ids and count on the host
            b, hq, most = idx.shape
            more = 1 if self.p.variant == "authors" else 0
            n_sel = max(1, min(int(self.count[0]) + more, cap, n))
            self.chosen[nxt] = idx[:, :, :n_sel]
            hi = self.ids[:idx.numel()].view(b, hq, most)[:, :, :n_sel]
            hkv = self.ctx.spec.n_kv_heads
            # row of (token, batch, KV head) in the token-major host buffer [n, B, Hkv]
            rows = ((hi * b + torch.arange(b)[:, None, None]) * hkv
                    + (torch.arange(hq) // (hq // hkv))[None, :, None]).flatten()
            j, m, d = nxt % 2, rows.numel(), self.host_k[nxt].shape[-1]
            if self.staged[j] is not None:
                self.staged[j].synchronize()  # the H2D that last read stage[j] is done
            if nxt in self.stored:
                self.stored.pop(nxt).synchronize()  # the layer's host KV has landed
            sel = []
            for host, stage in zip((self.host_k[nxt], self.host_v[nxt]), self.stage[j],
                                   strict=True):
                torch.index_select(host.view(-1, d), 0, rows, out=stage[:m])
                sel.append(stage[:m])
            # a prefetch for layer i+1's attention (the stage graph's look-ahead)
            counters.moved("h2d", 2.0 * m * d * self.ctx.elem_bytes, ahead=1)
            dev = self.ctx.accel
            if self.landing is not None:  # CPU-only: into the preallocated pair
                self.fetched[nxt] = tuple(transfer(dst[:m], t).view(b, hq, n_sel, d)
                                          for dst, t in zip(self.landing[j], sel, strict=True))
                return
            with torch.cuda.stream(self.stream):
                fk, fv = (transfer(torch.empty(m, d, dtype=t.dtype, device=dev), t)
                          for t in sel)
                done = torch.cuda.Event()
                done.record(self.stream)
            fk.record_stream(torch.cuda.current_stream())
            fv.record_stream(torch.cuda.current_stream())
            self.staged[j] = self.ready[nxt] = done
            self.fetched[nxt] = (fk.view(b, hq, n_sel, d), fv.view(b, hq, n_sel, d))

    def decode(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Attend the prefetched tokens and the new one (authors: those of them the final
        ranking keeps, `_ranked`); dense layers and steps read the whole cache."""
        import torch

        from kvbench.kernels.attention import dense_attention, merge

        self._prefetch(layer - 1)  # at the latest: a speculation layer i's call left queued
        n = self._store(layer, k, v)
        self._warm(layer, q, k)
        counters = self.ctx.counters
        fetched = self.fetched.pop(layer, None)
        if fetched is None:  # a dense layer, or one still warming: the whole cache
            self.chosen[layer] = None
            kc, vc = self._read(layer, n)
            counters.moved("h2d", 2.0 * kc.numel() * self.ctx.elem_bytes)
            counters.attended("accel", q, n)
            out = dense_attention(q, kc, vc, causal=False)[0]
            self._prefetch(layer)  # layer i+1's tokens, once this attention is queued
            return out
        if layer in self.ready:
            with counters.timed("accel_idle"):
                torch.cuda.current_stream().wait_event(self.ready.pop(layer))
        fk, fv = fetched  # [B, Hq, n', D]
        b, hq, m, d = fk.shape
        # the fetched tokens' attention and the new token's, lse-merged (a cat of the two
        # copied the fetched set: 0.56 ms a layer at 4 x 9 x 1024 x 64 float32)
        s = (q.float().view(b, k.shape[1], -1, d) * k.float()).sum(-1).view(b, hq, 1)
        if self.p.variant == "authors":
            cached, cur_in = self._ranked(layer, n, m)  # [B, Hq] each
            j = torch.arange(m + 1, device=q.device)
            pos = torch.where(j == cached[:, :, None], m, j)  # slots: fetched, then the new
            ids = self.chosen[layer]
            ids = torch.cat([ids, torch.full_like(ids[:, :, :1], n - 1)], dim=2)
            self.kept[layer] = (ids.gather(2, pos), cached + cur_in)
            first = j[:m].to(torch.int32).expand(b, hq, m).contiguous()
            out, lse = attend_selected(q, fk, fv, first, cached, counters)
            count_selected(q, cur_in.long(), counters)
            s = s.masked_fill(~cur_in[:, :, None], float("-inf"))
        else:
            counters.attention("accel", b * (m + 1.0), 4.0 * b * hq * (m + 1) * d,
                               2.0 * b * hq * (m + 1) * d * self.ctx.elem_bytes,
                               q.numel() * self.ctx.elem_bytes)
            out, lse = dense_attention(q, fk, fv, causal=False)
        # its one key: the output is its value, the lse its logit
        mine = v.expand(b, v.shape[1], hq // v.shape[1], d).reshape(b, hq, 1, d)
        out = merge(out, lse, mine, s * d ** -0.5)[0]
        self._prefetch(layer)
        return out

    def _ranked(self, layer: int, n: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """authors: the current token (position n - 1, just stored) ranked with the n - 1
        cached ones as the accuracy code ranks row n - 1: its partial score joins head 0's
        maximum and the mean count, n' = max(1, min(mean, cap)), and each head keeps its
        top n' of the n. Returns how many of the m fetched tokens (best first) it keeps and
        whether it keeps the current one, [B, Hq] each; on the device."""
        import torch

        pq, logits, vals, top0 = self.scores.pop(layer)
        d = self.ctx.spec.head_dim
        g = pq.shape[1] // self.part[layer].shape[1]
        pk = self.part[layer][:, :, n - 1:n].float().repeat_interleave(g, 1)  # [B, Hq, 1, w]
        cur = (pq * pk).sum(-1).squeeze(2) * d ** -0.5  # [B, Hq]
        thr = torch.maximum(top0, cur[:, :1]) - self.p.alpha  # [B, 1]
        count = (logits >= thr[:, :, None]).sum(-1) + (cur >= thr)  # [B, Hq]
        keep = count.float().mean().floor().clamp(1, self.cap(n - 1))
        cur_in = (vals[:, :, :m] > cur[:, :, None]).sum(-1) < keep  # [B, Hq]
        return (keep - cur_in.float()).long().clamp(max=m), cur_in
