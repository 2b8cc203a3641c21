"""A Llama decode step in one native call (probes/step.c through kvbench.kernels.step),
full attention's, Quest's and StreamingLLM's, against the layer-by-layer path on the same
weights and prompt: logits, the caches it writes and their lengths, Quest's digests and
selections, the stage graph and the counters, float32 to 1e-5, over several steps, on the
bundled model's shape and odd ones, batches 1 to 8, one and two threads, both instruction
sets of the matmul loops, a context long enough for attention's split-K merge, Quest's
selection rules and StreamingLLM's ring; where the decoder takes it; the ops it
dispatches."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import LLAMA_SHAPES

torch = pytest.importorskip("torch")

from kvbench.kernels import cpu  # noqa: E402
from kvbench.kernels import layer as native_layer  # noqa: E402
from kvbench.models import ModelSpec  # noqa: E402
from kvbench.runtime.bound import step_bytes  # noqa: E402
from kvbench.strategies.full import Full  # noqa: E402

needs_native = pytest.mark.skipif(cpu._lib() is None, reason="native library not built")


def _model(spec: ModelSpec, layers: int, batch: int, max_len: int, seed: int,
           strategy: type | str = Full, tied: bool = True, **params: Any) -> Any:
    """A decoder of `spec` with random weights (norm weights too) and `strategy` (its
    parameters but `params` the defaults)."""
    import dataclasses

    from kvbench.models.decoder import LlamaDecoder
    from kvbench.runtime.context import Counters, RunContext
    from kvbench.strategies import STRATEGIES

    spec = dataclasses.replace(spec, tied=tied)
    torch.manual_seed(seed)
    model = LlamaDecoder(spec, layers)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 1.0))
    cpu_dev = torch.device("cpu")
    counters = Counters(spec.n_kv_heads, 4, n_layers=layers)
    ctx = RunContext(spec, layers, batch, max_len, torch.float32, cpu_dev, cpu_dev, counters,
                     model)
    cls = STRATEGIES.get(strategy) if isinstance(strategy, str) else strategy
    model.setup(cls(dataclasses.replace(cls.params(), **params), ctx), counters, max_len)
    return model


def _decode(model: Any, tokens: Any, prompt: int, native: bool) -> list[Any]:
    """Prefill `prompt` tokens, then decode the rest one by one, natively (every step taken
    by the native call) or layer by layer, each step closed as the run closes it; the
    logits of each step."""
    if not native:
        model.native_step = lambda tokens, start: None
    model.counters.step = 0
    model(tokens[:, :prompt], 0)
    out = []
    for s in range(prompt, tokens.shape[1]):
        model.counters.step = s - prompt + 1
        model.counters.step_begin()
        assert (model.native_step(tokens[:, s:s + 1], s) is not None) == native
        out.append(model(tokens[:, s:s + 1], s))
        model.counters.step_end(0.0)  # as the run: the step's lazy counts summed
    return out


def _swapping(base: type, swap: Any) -> type:
    """A subclass of strategy `base` whose native_cache replaces fields of a layer's
    NativeCache by swap(cache) (None: the cache as is); its decode stays beside it, so the
    native step is built."""
    import dataclasses

    class Swapped(base):
        decode = base.decode

        def native_cache(self, layer: int) -> Any:
            c = super().native_cache(layer)
            new = swap(c)
            return c if new is None else dataclasses.replace(c, **new)

    return Swapped


@needs_native
@pytest.mark.parametrize("shape", LLAMA_SHAPES)
@pytest.mark.parametrize("batch", [1, 3, native_layer.MAX_ROWS])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_step_equals_the_layer_path(shape: tuple[int, int, int, int], batch: int,
                                           threads: int, isa: str) -> None:
    heads, kv, hidden, ffn = shape
    spec = ModelSpec("t", "llama", 3, heads, kv, hidden, ffn, 50, 64, rope_theta=1e4)
    _same(spec, 3, batch, threads, prompt=5, steps=3, seed=sum(shape) + batch)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_native_step_splits_a_long_context(threads: int) -> None:
    """600 cached keys of one sequence and KV head: attention splits them across the
    threads and merges the chunks inside the step's region."""
    spec = ModelSpec("t", "llama", 2, 4, 1, 64, 96, 50, 1024, rope_theta=1e4)
    _same(spec, 2, 1, threads, prompt=600, steps=2, seed=7)


QUEST = [  # (variant, per, sinks, window): the authors' accuracy path and the kernel path's
    ("authors", "query", 0, 1),
    ("kernel", "kv", 0, 1),
    ("kernel", "query", 1, 2),
]


@needs_native
@pytest.mark.parametrize("rule", QUEST)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_quest_step_equals_the_layer_path(rule: tuple[str, str, int, int], batch: int,
                                                 threads: int) -> None:
    """Quest's decode in the step (digests, page selection, attention over the selected
    pages; the first layer dense) as layer by layer: the same selections too. 40 cached
    tokens, pages of 4, 12 tokens a step: the sparse layers select from step one; the
    authors' floor of 3 pages and a window of 2 included."""
    variant, per, sinks, window = rule
    spec = ModelSpec("t", "llama", 3, 9, 3, 576, 1536, 50, 64, rope_theta=1e4)
    quest = {"variant": variant, "budget_tokens": 12, "page_size": 4, "dense_layers": 1}
    if variant == "kernel":
        quest |= {"topk_per": per, "sinks": sinks, "window_pages": window}
    _same(spec, 3, batch, threads, prompt=40, steps=4, seed=batch, strategy="quest", **quest)


@needs_native
def test_native_quest_step_with_every_layer_dense() -> None:
    """Quest with as many dense layers as the model has (`--layers 2` and the authors'
    two): no layer selects, however far past the budget the context; the step runs them
    as the layer path does (it failed with -2 before: its check of the selection rows'
    width counted layers without one)."""
    spec = ModelSpec("t", "llama", 2, 9, 3, 576, 1536, 50, 64, rope_theta=1e4)
    _same(spec, 2, 2, 2, prompt=40, steps=3, seed=5, strategy="quest", budget_tokens=8,
          page_size=4, dense_layers=2)


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("prompt", "budget"), [(20, 10), (5, 12)])
def test_native_streaming_step_equals_the_layer_path(threads: int, prompt: int,
                                                     budget: int) -> None:
    """StreamingLLM's ring in the step, 2 sinks: 8 recent slots over a 20-token prompt, 6
    steps writing round the ring; and a ring still filling (5 tokens of 12 slots: each step
    attends one slot more)."""
    spec = ModelSpec("t", "llama", 2, 9, 3, 576, 1536, 50, 64, rope_theta=1e4)
    _same(spec, 2, 3, threads, prompt=prompt, steps=6, seed=3, strategy="streaming",
          gpu_tokens=budget, sinks=2)


def _same(spec: ModelSpec, layers: int, batch: int, threads: int, prompt: int, steps: int,
          seed: int, **strategy: Any) -> Any:
    """The two paths' runs compared; the native one's counters."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    tokens = torch.randint(0, 50, (batch, prompt + steps),
                           generator=torch.Generator().manual_seed(seed))
    try:
        runs = []
        for native in (False, True):
            model = _model(spec, layers, batch, prompt + steps + 1, seed, **strategy)
            runs.append((model, _decode(model, tokens, prompt, native)))
    finally:
        torch.set_num_threads(before)
    (ref, ref_logits), (got, got_logits) = runs
    assert got._step is not None and got._step[1] is not None  # it was taken
    for r, g in zip(ref_logits, got_logits, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-4)
    n = prompt + steps
    count = "seen" if hasattr(ref.strategy, "seen") else "length"
    assert getattr(got.strategy, count) == getattr(ref.strategy, count) == [n] * layers
    for cache in ("k", "v"):  # every cached token, the ones the steps wrote too
        for a, b in zip(_layers(ref.strategy, cache), _layers(got.strategy, cache), strict=True):
            torch.testing.assert_close(b[:, :, :n], a[:, :, :n], rtol=1e-5, atol=1e-5)
    for a, b in zip(_layers(ref.strategy, "dig"), _layers(got.strategy, "dig"), strict=True):
        torch.testing.assert_close(b.lo, a.lo, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.hi, a.hi, rtol=1e-5, atol=1e-5)
    if hasattr(ref.strategy, "last"):  # Quest: the last step's selections
        assert sorted(ref.strategy.last) == sorted(got.strategy.last) == list(range(layers))
        for i in range(layers):
            a, b = ref.strategy.last[i], got.strategy.last[i]
            assert (a is None) == (b is None) == (i < ref.strategy.p.dense_layers)
            if a is not None:
                assert torch.equal(b[1], a[1])
    for name in ("slot_page", "pool_k", "pool_v", "host_k", "host_v"):  # ArkVale's pool
        for a, b in zip(_layers(ref.strategy, name), _layers(got.strategy, name), strict=True):
            if name.startswith("host"):  # the pages backed up (the rest never written)
                full = (n - 1) // ref.strategy.p.page_size
                a, b = a[:full], b[:full]
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    if hasattr(ref.strategy, "dig"):
        for i in range(layers):
            assert torch.equal(got.strategy.attended(i), ref.strategy.attended(i))
    # the same stage graph (bytes per memory each step) and counters (tokens, FLOPs, bytes)
    graphs = [m.counters.graph.steps() for m in (ref, got)]
    for s in range(1, steps + 1):
        assert step_bytes(graphs[1][s]) == step_bytes(graphs[0][s])
        assert [(t.layer, t.resource, t.op) for t in graphs[1][s]] == \
            [(t.layer, t.resource, t.op) for t in graphs[0][s]]
    series = [{(q, w, lay): v for q, w, lay, v in m.counters.series() if q != "time"}
              for m in (ref, got)]
    assert series[1] == series[0]
    phases = [{(w, lay) for q, w, lay, _ in m.counters.series() if q == "time"}
              for m in (ref, got)]
    assert phases[1] == phases[0]  # the same stages timed (each layer's attention, selection)
    times = {lay: v for q, w, lay, v in got.counters.series() if (q, w) == ("time", "attention")}
    assert sorted(times) == list(range(layers))
    assert all(times[lay][s] > 0 for lay in times for s in range(1, steps + 1))
    return got.counters


def _layers(strategy: Any, name: str) -> list[Any]:
    """A strategy's per-layer state `name` (a list, or a dict by layer), in layer order."""
    got = getattr(strategy, name, [])
    return [got[i] for i in sorted(got)] if isinstance(got, dict) else list(got)


@needs_native
def test_where_the_decoder_takes_it() -> None:
    """Full attention's, Quest's and StreamingLLM's decode rows on the native layers, untied
    head too; not a strategy that attends otherwise, not a subclass with its own decode, not
    bfloat16, not when the cache's length is not the step's position; prefill rows
    never."""
    from kvbench.kernels.step import Step

    spec = ModelSpec("t", "llama", 2, 4, 2, 40, 36, 50, 64, rope_theta=1e4)
    tokens = torch.randint(0, 50, (2, 6))

    def taken(model: Any, start: int = 5) -> bool:
        model(tokens[:, :5], 0)
        return model.native_step(tokens[:, 5:], start) is not None

    assert taken(_model(spec, 2, 2, 16, 0))
    assert taken(_model(spec, 2, 2, 16, 0, tied=False))
    assert taken(_model(spec, 2, 2, 16, 0, strategy="quest"))
    assert not taken(_model(spec, 2, 2, 16, 0), start=4)  # the cache holds 5 tokens
    assert taken(_model(spec, 2, 2, 64, 0, strategy="streaming"))
    assert not taken(_model(spec, 2, 2, 64, 0, strategy="h2o"))

    class Own(Full):
        def decode(self, layer: int, q: Any, k: Any, v: Any) -> Any:
            return super().decode(layer, q, k, v)

    assert not taken(_model(spec, 2, 2, 16, 0, strategy=Own))
    assert taken(_model(spec, 1, 2, 16, 0))  # a model of one layer
    model = _model(spec, 2, 2, 16, 0)
    model(tokens[:, :5], 0)
    assert model.native_step(tokens[:, :5], 5) is None  # not decode rows
    assert model.native_step(tokens[:, 5:].int(), 5) is None  # the step reads int64 ids
    model = _model(spec, 2, 2, 16, 0).to(torch.bfloat16)
    model.pack(2)
    assert Step.build(model) is None


@needs_native
def test_a_slot_outside_the_cache_is_refused() -> None:
    """A strategy whose native_cache puts the new token (or the attended span) past its
    slots gets a one-line error, not a native write out of bounds."""
    import dataclasses

    from kvbench.errors import KvbenchError
    from kvbench.strategies.streaming import Streaming

    class Past(Streaming):
        decode = Streaming.decode  # beside its own native_cache: the step is taken

        def native_cache(self, layer: int) -> Any:
            c = super().native_cache(layer)
            return dataclasses.replace(c, slot=c.k.shape[2])

    spec = ModelSpec("t", "llama", 2, 4, 2, 40, 36, 50, 64, rope_theta=1e4)
    model = _model(spec, 2, 2, 64, 0, strategy=Past, gpu_tokens=8, sinks=2)
    tokens = torch.randint(0, 50, (2, 21))
    model(tokens[:, :20], 0)
    with pytest.raises(KvbenchError, match="slot 8 and span 8 outside its caches' 8 slots"):
        model(tokens[:, 20:], 20)


@needs_native
@pytest.mark.parametrize("change", ["embedding", "embedding dtype", "head", "head dtype",
                                    "norm", "layers"])
def test_a_model_the_call_cannot_read_goes_layer_by_layer(change: str) -> None:
    """An embedding or head the call cannot read row by row (strided, not float32), a final
    norm that is not float32, a model off the native layers: no step is built."""
    from kvbench.kernels.step import Step

    spec = ModelSpec("t", "llama", 2, 4, 2, 40, 36, 50, 64, rope_theta=1e4)
    model = _model(spec, 2, 2, 16, 0, tied=False)
    model(torch.randint(0, 50, (2, 5)), 0)
    assert Step.build(model) is not None
    with torch.no_grad():
        if change == "embedding":
            model.embed_tokens.weight = torch.nn.Parameter(torch.randn(50, 80)[:, ::2])
        elif change == "embedding dtype":
            model.embed_tokens.weight = torch.nn.Parameter(model.embed_tokens.weight.double())
        elif change == "head":
            model.lm_head.weight = torch.nn.Parameter(torch.randn(50, 80)[:, ::2])
        elif change == "head dtype":
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.double())
        elif change == "norm":
            model.norm.weight = torch.nn.Parameter(model.norm.weight.double())
        else:
            model.native_layers = False
    assert Step.build(model) is None


@needs_native
@pytest.mark.parametrize("change", ["as is", "none", "k dtype"])
def test_caches_the_call_cannot_read_build_no_step(change: str) -> None:
    """A strategy whose native_cache gives None for a layer, or a cache that is not float32:
    no step is built (the call would read it as float32)."""
    import dataclasses

    from kvbench.kernels.step import Step

    class Odd(Full):
        decode = Full.decode  # beside its own native_cache: the step is built

        def native_cache(self, layer: int) -> Any:
            c = super().native_cache(layer)
            if layer == 0 or change == "as is":
                return c
            return None if change == "none" else dataclasses.replace(c, k=c.k.double())

    spec = ModelSpec("t", "llama", 2, 4, 2, 40, 36, 50, 64, rope_theta=1e4)
    model = _model(spec, 2, 2, 16, 0, strategy=Odd)
    model(torch.randint(0, 50, (2, 5)), 0)
    assert (Step.build(model) is not None) == (change == "as is")


@needs_native
@pytest.mark.parametrize(("slot", "span", "ok"), [
    (0, 1, True), (5, 6, True), (15, 16, True),  # the first and last slots
    (-1, 6, False), (16, 16, False), (3, 17, False), (5, 5, False), (5, 4, False)])
def test_where_a_native_step_writes_and_reads_is_checked(slot: int, span: int,
                                                         ok: bool) -> None:
    """The new token's slot must lie in the caches' 16 slots and the attended span cover it
    and stay inside them; anything else is one line, before the call."""
    from kvbench.errors import KvbenchError

    At = _swapping(Full, lambda c: {"slot": slot, "span": span})
    spec = ModelSpec("t", "llama", 2, 4, 2, 40, 36, 50, 64, rope_theta=1e4)
    model = _model(spec, 2, 2, 16, 0, strategy=At)
    tokens = torch.randint(0, 50, (2, 6))
    model(tokens[:, :5], 0)
    if ok:
        assert model.native_step(tokens[:, 5:], 5) is not None
    else:
        with pytest.raises(KvbenchError, match="outside its caches' 16 slots"):
            model.native_step(tokens[:, 5:], 5)


@needs_native
@pytest.mark.parametrize("change", ["no hi", "no lens", "idx int64", "lens strided"])
def test_a_selection_the_call_cannot_read_is_refused(change: str) -> None:
    """A Quest whose native_cache gives digests without both halves, a selection without
    its lengths, or buffers that are not contiguous int32: one line when the step is
    built, not a native read of the wrong width."""
    from kvbench.errors import KvbenchError
    from kvbench.strategies.quest import Quest

    def swap(c: Any) -> dict[str, Any] | None:
        if c.idx is None:
            return None
        strided = torch.zeros(c.lens.shape[0], 2 * c.lens.shape[1], dtype=torch.int32)
        return {"no hi": {"hi": None}, "no lens": {"lens": None},
                "idx int64": {"idx": c.idx.long()},
                "lens strided": {"lens": strided[:, ::2]}}[change]

    Bad = _swapping(Quest, swap)
    spec = ModelSpec("t", "llama", 2, 4, 2, 40, 36, 50, 64, rope_theta=1e4)
    model = _model(spec, 2, 2, 64, 0, strategy=Bad, budget_tokens=8, page_size=4,
                   dense_layers=1)
    tokens = torch.randint(0, 50, (2, 41))
    model(tokens[:, :40], 0)
    what = "NativeCache gives digests without both lo and hi" if change.startswith("no") \
        else r"selection \(idx, lens\) is not contiguous int32"
    with pytest.raises(KvbenchError, match=f"^native step: a layer's {what}"):
        model(tokens[:, 40:], 40)


@needs_native
def test_a_token_outside_the_embedding_is_refused() -> None:
    """The step looks the tokens' rows up itself: an id past the vocabulary gets a one-line
    error (torch's lookup raises one too), not a native read past the table."""
    from kvbench.errors import KvbenchError

    spec = ModelSpec("t", "llama", 2, 4, 2, 40, 36, 50, 64, rope_theta=1e4)
    model = _model(spec, 2, 2, 16, 0)
    tokens = torch.randint(0, 50, (2, 6))
    model(tokens[:, :5], 0)
    tokens[1, 5] = 50
    with pytest.raises(KvbenchError, match="native decode step failed"):
        model(tokens[:, 5:], 5)


@needs_native
@pytest.mark.parametrize(("change", "message"), [
    ("lo", "a pool without its digests, host backup"),
    ("bk", "a pool without its digests, host backup"),
    ("moved", "a pool without its digests, host backup"),
    ("slot_page int32", "pool needs contiguous int64 slot_page")])
def test_a_pool_the_call_cannot_read_is_refused(change: str, message: str) -> None:
    """An ArkVale whose native_cache leaves out what its recall reads, or gives its
    slot_page as int32, gets a one-line error when the step is built, not a native read
    through a null pointer or of the wrong width."""
    from kvbench.errors import KvbenchError
    from kvbench.strategies.arkvale import ArkVale

    Partial = _swapping(ArkVale, lambda c: None if c.slot_page is None else (
        {change: None} if change != "slot_page int32" else {"slot_page": c.slot_page.int()}))
    spec = ModelSpec("t", "llama", 2, 4, 2, 40, 36, 50, 64, rope_theta=1e4)
    model = _model(spec, 2, 2, 64, 0, strategy=Partial, budget_tokens=16, page_size=4,
                   pages=2, sinks=1, window_pages=1, dense_layers=1)
    tokens = torch.randint(0, 50, (2, 41))
    model(tokens[:, :40], 0)
    with pytest.raises(KvbenchError, match=message):
        model(tokens[:, 40:], 40)


@needs_native
def test_a_pool_slot_naming_a_page_not_completed_fails_the_step() -> None:
    """ArkVale's slot_page naming a page past the completed ones (bookkeeping gone wrong)
    fails the native step with one line instead of copying from past the host backup."""
    from kvbench.errors import KvbenchError

    spec = ModelSpec("t", "llama", 2, 4, 2, 40, 36, 50, 64, rope_theta=1e4)
    model = _model(spec, 2, 2, 64, 0, strategy="arkvale", budget_tokens=16, page_size=4,
                   pages=2, sinks=1, window_pages=1, dense_layers=1)
    tokens = torch.randint(0, 50, (2, 41))
    model(tokens[:, :40], 0)
    model.strategy.slot_page[1][1, 0, 2] = 1000
    with pytest.raises(KvbenchError, match=r"native decode step failed \(-1\)"):
        model(tokens[:, 40:], 40)


@needs_native
@pytest.mark.parametrize("strategy", ["full", "quest"])
def test_a_native_step_dispatches_a_few_ops_whatever_the_layers(strategy: str) -> None:
    """The token's slice and the logits buffer (the embedding rows are looked up in the
    call): the same two ops with 2 layers as with 6 (quest's sparse layers selecting), and
    no sync."""
    from kvbench.runtime.opcount import Counting

    spec = ModelSpec("t", "llama", 6, 4, 2, 40, 36, 50, 64, rope_theta=1e4)
    quest = {"budget_tokens": 8, "page_size": 4, "dense_layers": 1} if strategy == "quest" \
        else {}
    counts = []
    for layers in (2, 6):
        model = _model(spec, layers, 2, 40, 0, strategy=strategy, **quest)
        tokens = torch.randint(0, 50, (2, 34))
        model(tokens[:, :32], 0)
        model(tokens[:, 32:33], 32)  # the step is built on its first use
        with Counting() as c:
            model(tokens[:, 33:], 33)
        assert model._step[1] is not None
        assert c.syncs_by_op == {}
        counts.append(dict(c.by_op))
    assert counts[0] == counts[1]
    assert sum(counts[0].values()) <= 2


ARKVALE = [  # (variant, window pages, dense layers)
    ("authors", 2, 1),
    ("per-kv-head", 2, 0),
    ("authors", 1, 1),
]


@needs_native
@pytest.mark.parametrize("rule", ARKVALE)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_arkvale_step_equals_the_layer_path(rule: tuple[str, int, int], batch: int,
                                                   threads: int) -> None:
    """ArkVale's decode in the step (the pool's top pages recalled from the host backup,
    attention over the pool and the current page) as layer by layer: the same pools, slots,
    digests and backups too. 70 cached tokens in pages of 4 over a pool of 5 pages, 3 kept:
    every sparse layer selects each step, recalling pages into a full pool, and steps 3 and
    7 complete a page first (with one window page, it is recalled if selected)."""
    variant, window, dense = rule
    spec = ModelSpec("t", "llama", 3, 9, 3, 576, 1536, 50, 96, rope_theta=1e4)
    counters = _same(spec, 3, batch, threads, prompt=70, steps=7, seed=batch,
                     strategy="arkvale", variant=variant, budget_tokens=24, page_size=4,
                     pages=3, sinks=1, window_pages=window, dense_layers=dense)
    pages = {(w, lay): v for q, w, lay, v in counters.series() if q == "pages"}
    for what in ("recalled", "evicted"):  # the steps recalled pages into full pools
        assert sum(v for (w, lay), steps in pages.items() if w == what
                   for s, v in steps.items() if s > 0) >= 3 * batch


@needs_native
@pytest.mark.parametrize("prompt", [16, 20])
def test_arkvale_takes_the_native_step_once_its_pool_is_full(prompt: int) -> None:
    """A pool of 5 pages of 4: after 16 tokens the step's completed page is the pool's
    fourth (a gap before the current page: layer by layer), after 20 its fifth (full: the
    native step, the pool just full and not selecting, then over it), each step as the
    layer path."""
    spec = ModelSpec("t", "llama", 2, 4, 2, 40, 36, 50, 64, rope_theta=1e4)
    arkvale = {"strategy": "arkvale", "budget_tokens": 24, "page_size": 4, "pages": 3,
               "sinks": 1, "window_pages": 2, "dense_layers": 1}
    model = _model(spec, 2, 2, 64, 0, **arkvale)
    tokens = torch.randint(0, 50, (2, prompt + 1))
    model(tokens[:, :prompt], 0)
    assert (model.native_step(tokens[:, prompt:], prompt) is not None) == (prompt == 20)
    if prompt == 20:
        _same(spec, 2, 2, 2, prompt=20, steps=6, seed=1, **arkvale)


@needs_native
def test_arkvale_steps_note_their_backends_by_phase() -> None:
    """The prefill's cut of ArkVale's pool (torch page scores of the prompt's last query)
    is noted as prefill, so a decode taken by the native step records that alone; layer by
    layer, a decode's selection is noted as decode."""
    from kvbench.kernels.attention import backend_use

    spec = ModelSpec("t", "llama", 2, 4, 2, 40, 36, 50, 64, rope_theta=1e4)
    model = _model(spec, 2, 2, 64, 0, strategy="arkvale", budget_tokens=16, page_size=4,
                   pages=2, sinks=1, window_pages=1, dense_layers=1)
    tokens = torch.randint(0, 50, (2, 41))
    backend_use(reset=True)
    model(tokens[:, :40], 0)
    prefill = backend_use(reset=True)
    model(tokens[:, 40:], 40)
    assert "torch-select" in prefill["prefill/append"] and "decode" not in prefill
    assert backend_use(reset=True) == {"decode": "native-step"}
    model = _model(spec, 2, 2, 64, 0, strategy="arkvale", budget_tokens=16, page_size=4,
                   pages=2, sinks=1, window_pages=1, dense_layers=1)
    model.native_step = lambda tokens, start: None  # layer by layer: its decode selects
    model(tokens[:, :40], 0)
    backend_use(reset=True)
    model(tokens[:, 40:], 40)
    assert "torch-select" in backend_use(reset=True)["decode"]


def test_native_step_accounts_once_its_clock_stopped() -> None:
    """A native step's call records nothing: its accounting (the strategy's `decoded`, each
    layer's work and attention seconds) waits for the step's end (`flush`, at step_end,
    settle or the next forward), and is filed under the step that ran, not the one the
    counters have moved on to."""
    from kvbench.kernels.attention import backend_use

    spec = ModelSpec("t", "llama", 2, 4, 2, 40, 36, 50, 64, rope_theta=1e4)
    model = _model(spec, 2, 2, 64, 0)
    c, s = model.counters, model.strategy
    tokens = torch.randint(0, 50, (2, 42))
    model(tokens[:, :40], 0)
    c.step, n0 = 1, len(c.graph.tasks)
    model(tokens[:, 40:41], 40)
    assert model.native_step(tokens[:, 41:], 41) is None  # its length not yet counted
    assert len(c.graph.tasks) == n0 and s.length == [40, 40]
    c.step = 2
    c.flush()
    assert s.length == [41, 41] and c.step == 2
    filed = c.graph.tasks[n0:]
    assert filed and {t.step for t in filed} == {1}
    assert {t.op for t in filed} >= {"pre", "post", "head"}
    assert c.step_total("time", "attention", 1) > 0
    backend_use(reset=True)
    model(tokens[:, 41:], 41)  # the native step again: the forward ran what was pending
    assert backend_use(reset=True) == {"decode": "native-step"} and s.length == [41, 41]
    c.flush()
    assert s.length == [42, 42]
