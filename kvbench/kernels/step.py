"""A Llama decode step in one native call (probes/step.c): full attention, Quest, StreamingLLM,
ArkVale.

Issue 26 asks for every strategy's decode step in a bounded number of calls and the
reference itself near its bytes bound. Layer by layer (kvbench.kernels.layer) a decode step
makes three native calls a layer with Python and a dozen small torch ops between them (the
new k/v's cache writes, views, buffers, a strategy's bookkeeping), each call a new OpenMP
region: on the bundled model at batch 1 about 1.5 ms of a 15 ms step went to the Python
between the calls, and the weights' memory stream stalled at every one. Here the whole
step, every layer's norms, projections, RoPE, the new token's k/v written into the cache,
the strategy's attention, the MLP, then the final norm and the logits head, runs in one
region whose threads meet at barriers; the call starts from the tokens' rows of the
embedding table (`Decoder.embed_table`, a plain lookup), copied in C: torch's lookup, with
its Python, took 60 us of a KV-bound step (2-core AMD EPYC VM, 2026-11-27).

A strategy offers it through `Strategy.native_cache` (per layer a `NativeCache`: its cache,
where the new token goes and how much of it is attended, for Quest its min/max digests and
selection buffers, for ArkVale its pool's pages, digests and host backup) and
`Strategy.native_rule` (the step's selection rule, Quest's `Pages` or ArkVale's `Recall`,
after the bookkeeping that must precede the call); after the call it does its per-layer
bookkeeping in `Strategy.decoded`, and the decoder records the same stage graph as layer by
layer, each layer's attention and selection timed inside the call (thread 0's clock). `Step.build`
takes it for decode rows of a model on the native layers (float32 CPU Llama layers,
kvbench.kernels.layer.ok) with a row-major float32 head, when every layer's cache is a
float32 CPU one; otherwise the decoder goes layer by layer.

Shapes: tokens [B, 1]; x [B, hidden]; caches [B, Hkv, slots, D]; digests [B, Hkv, P, D];
selections idx [B, H, ld] int32 (H: KV or query heads), lens [B, H]; ArkVale's slot_page
[B, Hkv, C] int64 and host backup [P, B, Hkv, S, D]; logits [B, vocab].
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbench.errors import KvbenchError
from kvbench.kernels.attention import note_backend
from kvbench.kernels.cpu import _lib
from kvbench.kernels.layer import rope_at
from kvbench.timing import kernel

if TYPE_CHECKING:
    import torch

    from kvbench.models.decoder import LlamaDecoder


@dataclass(frozen=True)
class NativeCache:
    """What a native step reads and writes of one layer: its cache k/v [B, Hkv, slots, D]
    after n tokens (the step's position), the slot the new token goes to (`slot`, default
    n) and how many slots from 0 the step then attends (`span`, default n + 1: every
    token); for Quest its min/max digests lo/hi [B, Hkv, P, D] (the token's key joins
    them) with, on a layer that selects pages, the buffers of its selection idx [B, H, ld]
    and lens [B, H] int32; for ArkVale's pool (the cache: pages of S contiguous rows) its
    digests, slot_page [B, Hkv, C] int64, the host backup bk/bv [P, B, Hkv, S, D] the
    recalls copy from and `moved` (pages recalled, evicted: the call writes them). `ok`
    False: the step cannot run this layer now (ArkVale's pool not yet full); the decoder
    goes layer by layer."""

    k: torch.Tensor
    v: torch.Tensor
    n: int
    lo: torch.Tensor | None = None
    hi: torch.Tensor | None = None
    idx: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    slot: int | None = None
    span: int | None = None
    slot_page: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    moved: ctypes.Array[ctypes.c_int64] | None = None
    ok: bool = True


@dataclass(frozen=True)
class Pages:
    """Quest's selection in a step (probes/step.c's kvb_pages_t): pages of `page` tokens,
    `k` kept per row (k >= the pages cached: every layer attends densely this step), the
    first `sinks` and last `window` pages forced in, one set per KV group (`per_kv`) or per
    query head."""

    page: int
    k: int
    sinks: int
    window: int
    per_kv: bool


@dataclass(frozen=True)
class Recall:
    """ArkVale's selection and recall in a step (probes/decode.h's kvb_recall_t): pages of
    `page` tokens, a pool of `slots` full pages, `nf` pages completed (the layers select
    when nf > slots), `k` kept, the first `sinks` and last `window` full pages forced in,
    pages >= `fresh` completed this step (copied, not recalled), one set per sequence
    (`per_layer`) or per KV head."""

    page: int
    slots: int
    nf: int
    k: int
    sinks: int
    window: int
    fresh: int
    per_layer: bool


def moved() -> ctypes.Array[ctypes.c_int64]:
    """A layer's (pages recalled, pages evicted) that a native step writes."""
    return (ctypes.c_int64 * 2)()


class Layer(ctypes.Structure):
    """probes/step.c's kvb_layer_t: one layer's weights, its cache, digests and selection."""

    _fields_ = [(n, ctypes.c_void_p) for n in ("nw1", "wqkv", "wo", "nw2", "wgu", "wd",
                                                "kc", "vc")] + \
        [("ks", ctypes.c_int64 * 3), ("vs", ctypes.c_int64 * 3), ("lo", ctypes.c_void_p),
         ("hi", ctypes.c_void_p), ("ds", ctypes.c_int64 * 3), ("idx", ctypes.c_void_p),
         ("lens", ctypes.c_void_p), ("at", ctypes.c_int64), ("n", ctypes.c_int64),
         ("slot_page", ctypes.c_void_p), ("bk", ctypes.c_void_p), ("bv", ctypes.c_void_p),
         ("moved", ctypes.c_void_p)]


class _Pages(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("page", "k", "sinks", "window", "ld")] + \
        [("per_kv", ctypes.c_int)]


class _Recall(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("page", "slots", "nf", "k", "sinks", "window",
                                              "fresh")] + [("per_layer", ctypes.c_int)]


def _usable(t: torch.Tensor | None) -> bool:
    import torch

    return t is None or (t.device.type == "cpu" and t.dtype == torch.float32
                         and t.stride(-1) == 1)


def _owner(obj: object, name: str) -> type:
    """The class in obj's MRO that defines `name`."""
    return next(c for c in type(obj).__mro__ if name in c.__dict__)


def _layer(layer: object, c: NativeCache) -> Layer:
    import torch

    if (c.lo is None) != (c.hi is None) or (c.idx is None) != (c.lens is None) or (
            c.slot_page is not None and None in (c.lo, c.bk, c.bv, c.moved)):
        raise KvbenchError("native step: a layer's NativeCache gives digests without both "
                           "lo and hi, a selection without its lengths, or a pool without "
                           "its digests, host backup and counts")
    a, m = layer.self_attn, layer.mlp
    out = Layer(*(t.data_ptr() for t in (
        layer.input_layernorm.weight, a.qkv_proj.weight, a.o_proj.weight,
        layer.post_attention_layernorm.weight, m.gate_up_proj.weight, m.down_proj.weight,
        c.k, c.v)), tuple(c.k.stride()[:3]), tuple(c.v.stride()[:3]))
    if c.lo is not None:
        out.lo, out.hi, out.ds = c.lo.data_ptr(), c.hi.data_ptr(), tuple(c.lo.stride()[:3])
    if c.idx is not None:
        if not (c.idx.dtype == c.lens.dtype == torch.int32 and c.idx.is_contiguous()
                and c.lens.is_contiguous()):
            raise KvbenchError("native step: a layer's selection (idx, lens) is not "
                               "contiguous int32")
        out.idx, out.lens = c.idx.data_ptr(), c.lens.data_ptr()
    if c.slot_page is not None:
        if not (c.slot_page.dtype == torch.int64 and c.slot_page.is_contiguous() and
                c.k.stride()[2:] == c.v.stride()[2:] == (c.k.shape[3], 1)):
            raise KvbenchError("native step: a layer's pool needs contiguous int64 "
                               "slot_page and pages of contiguous rows")
        out.slot_page, out.moved = c.slot_page.data_ptr(), ctypes.addressof(c.moved)
        out.bk, out.bv = c.bk.data_ptr(), c.bv.data_ptr()
    return out


class Step:
    """The native decode step of one model and one strategy's caches (pointers only: the
    decoder keeps it while that strategy is its own)."""

    def __init__(self, model: LlamaDecoder, layers: ctypes.Array[Layer], head: torch.Tensor,
                 emb: torch.Tensor, q: torch.Tensor, ld: int, slots: list[int]) -> None:
        import torch

        self.model, self.layers, self.head, self.emb = model, layers, head, emb
        self.q = q  # [B, Hq, 1, D]: the shape the strategy's `decoded` counts with
        self.x = torch.empty(q.shape[0], emb.shape[1])  # the residual stream [B, hidden]
        self.ld = ld  # a selection row's length (0: no layer selects)
        # each layer's struct and its caches' slots (the buffers are fixed while we live)
        self.each = list(zip(layers, slots, strict=True))
        self.seconds = (ctypes.c_double * len(layers))()  # each layer's attention
        self.select = (ctypes.c_double * len(layers))()  # and its selection (-1: none)

    @classmethod
    def build(cls, model: LlamaDecoder) -> Step | None:
        """The step for `model` and its strategy, or None when either does not suit it."""
        import torch

        from kvbench.strategies import Strategy

        s, norm = model.strategy, model.norm
        if _owner(s, "decode") is not _owner(s, "native_cache") or \
                _owner(s, "layer_input") is not Strategy:
            return None  # a subclass with a decode or layer_input of its own sees every layer
        head, emb = model.tied(), model.embed_table()
        head = model.lm_head.weight if head is None else head
        if not (model.native_layers and _usable(head) and head.is_contiguous()
                and emb is not None and _usable(emb) and emb.is_contiguous()
                and _usable(norm.weight) and all(
                    n.eps == norm.eps for x in model.layers
                    for n in (x.input_layernorm, x.post_attention_layernorm))):
            return None
        out, ld, slots = (Layer * len(model.layers))(), 0, []
        for i, layer in enumerate(model.layers):
            c = s.native_cache(i)
            if c is None or not all(_usable(t) for t in (c.k, c.v, c.lo, c.hi, c.bk, c.bv)) \
                    or not all(t is None or t.is_contiguous() for t in (c.bk, c.bv)):
                return None
            out[i] = _layer(layer, c)
            ld = ld if c.idx is None else c.idx.shape[-1]
            slots.append(min(c.k.shape[2], c.v.shape[2]))
        a = model.layers[0].self_attn
        return cls(model, out, head, emb, torch.empty(c.k.shape[0], a.hq, 1, a.nq // a.hq),
                   ld, slots)

    def ready(self, tokens: torch.Tensor, start: int) -> bool:
        """Whether tokens [B, 1] (int64 on the CPU) are the caches' batch and every layer's
        cache can run now at position `start` (its slot and span kept for the call);
        KvbenchError for a slot or span outside a cache's slots (the native call would write
        or read past them)."""
        import torch

        s = self.model.strategy
        if tokens.shape[0] != self.q.shape[0] or tokens.dtype != torch.int64 or \
                tokens.device.type != "cpu":
            return False
        for i, (layer, slots) in enumerate(self.each):
            c = s.native_cache(i)
            if not c.ok or c.n != start:
                return False  # the call does not run: the slots set so far are not read
            slot = start if c.slot is None else c.slot
            span = start + 1 if c.span is None else c.span
            if not (0 <= slot < slots and slot < span <= slots):
                raise KvbenchError(f"{s.name}: native step slot {slot} and span {span} "
                                   f"outside its caches' {slots} slots")
            layer.at, layer.n = slot, span
        return True

    def __call__(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Logits [B, vocab] of decode rows tokens [B, 1] at position `start`; the strategy's
        `decoded` and the stage graph per layer follow once the step's clock has stopped
        (`_account`)."""
        m = self.model
        logits = self._run(tokens, start, m.strategy.native_rule(start + 1))
        note_backend("native-step", self.q)  # every layer's attention, in the call
        m.counters.after_step(self._account)
        return logits

    def _account(self) -> None:
        """What the last call did, per layer: the strategy's `decoded` (its lengths, its
        selection and counters) and the layers' work and attention seconds. Deferred to the
        step's end (Counters.after_step) and run before the next forward (Decoder.forward):
        on the bundled model at batch 1 these 30 layers' records took 0.4 ms of a 13 ms step
        (2-core AMD EPYC VM, 2026-11-27), kvbench's bookkeeping timed as the step's."""
        m = self.model
        c, spec, rows = m.counters, m.spec, self.q.shape[0]
        for i in range(len(self.layers)):
            c.layer = i
            c.dense(spec, "pre", rows)
            m.strategy.decoded(i, self.q, self.select[i])
            c.elapsed("attention", self.seconds[i])
            c.dense(spec, "post", rows)
        c.dense(spec, "head", rows)

    @kernel
    def _run(self, tokens: torch.Tensor, start: int, rule: Pages | Recall | None
             ) -> torch.Tensor:
        import torch

        m, x = self.model, self.x
        a, norm = m.layers[0].self_attn, m.norm
        d = a.nq // a.hq
        logits = x.new_empty(x.shape[0], self.head.shape[0])
        pages = None if not isinstance(rule, Pages) else _Pages(
            rule.page, rule.k, rule.sinks, rule.window, self.ld, int(rule.per_kv))
        recall = None if not isinstance(rule, Recall) else _Recall(
            rule.page, rule.slots, rule.nf, rule.k, rule.sinks, rule.window, rule.fresh,
            int(rule.per_layer))
        rc = _lib().kvb_llama_step(
            self.layers, len(self.layers), None if pages is None else ctypes.byref(pages),
            None if recall is None else ctypes.byref(recall), tokens.data_ptr(),
            tokens.stride(0), self.emb.data_ptr(), self.emb.shape[0], x.data_ptr(), norm.eps,
            norm.weight.data_ptr(), self.head.data_ptr(), self.head.shape[0], logits.data_ptr(),
            *rope_at(m._rope, start), d ** -0.5, start, x.shape[0], x.shape[1], a.hq, a.hkv, d,
            m.layers[0].mlp.down_proj.weight.shape[1], self.seconds, self.select,
            torch.get_num_threads())
        if rc != 0:
            raise KvbenchError(f"native decode step failed ({rc})")
        return logits
