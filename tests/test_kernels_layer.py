"""A Llama layer's decode in two native calls (probes/layer.c through kvbench.kernels.layer)
against the module path on the same weights and input: what the strategy is handed (h, q,
k, v) and the layer's output, float32 to 1e-5, on the bundled model's shape and odd ones
(head dims, groups, the matmuls' scalar tails), every batch it takes, one and two threads,
both instruction sets of the matmul loops (their residual-accumulating rows too);
where the decoder takes it; and the ops it dispatches."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import LLAMA_SHAPES

torch = pytest.importorskip("torch")

from kvbench.kernels import cpu  # noqa: E402
from kvbench.kernels import layer as native_layer  # noqa: E402
from kvbench.models import ModelSpec  # noqa: E402

needs_native = pytest.mark.skipif(cpu._lib() is None, reason="native library not built")


def _model(spec: ModelSpec, batch: int, seed: int) -> tuple[Any, list[dict[str, Any]]]:
    """A 2-layer decoder of `spec` with random weights (norm weights too) and a strategy
    that records what each layer hands it and attends densely over that token alone."""
    from kvbench.models.decoder import LlamaDecoder
    from kvbench.runtime.context import Counters, RunContext
    from kvbench.strategies.full import Full

    seen: list[dict[str, Any]] = []

    class Recorder(Full):
        def layer_input(self, layer: int, x: Any) -> None:
            seen.append({"h": x.clone()})

        def decode(self, layer: int, q: Any, k: Any, v: Any) -> Any:
            seen[-1].update(q=q.clone(), k=k.clone(), v=v.clone())
            return super().decode(layer, q, k, v)

    torch.manual_seed(seed)
    model = LlamaDecoder(spec, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 1.0))
    cpu_dev = torch.device("cpu")
    counters = Counters(spec.n_kv_heads, 4)
    ctx = RunContext(spec, 2, batch, 16, torch.float32, cpu_dev, cpu_dev, counters, model)
    model.setup(Recorder(None, ctx), counters, 16)
    return model, seen


@needs_native
@pytest.mark.parametrize("shape", LLAMA_SHAPES)
@pytest.mark.parametrize("batch", [1, 3, native_layer.MAX_ROWS])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_layer_equals_the_module_path(shape: tuple[int, int, int, int], batch: int,
                                             threads: int, isa: str) -> None:
    heads, kv, hidden, ffn = shape
    spec = ModelSpec("t", "llama", 2, heads, kv, hidden, ffn, 50, 64, rope_theta=1e4)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = []
        for native in (False, True):
            model, seen = _model(spec, batch, seed=sum(shape) + batch)
            tokens = torch.randint(0, 50, (batch, 6), generator=torch.Generator().manual_seed(1))
            model(tokens[:, :5], 0)  # prefill: the module path either way
            assert model.native_layers  # the decode batch's layout allows it
            model.native_layers = native
            seen.clear()
            logits = model(tokens[:, 5:], 5)
            runs.append((logits, seen))
    finally:
        torch.set_num_threads(before)
    (ref, ref_seen), (got, got_seen) = runs
    assert len(got_seen) == len(ref_seen) == 2
    for r, g in zip(ref_seen, got_seen, strict=True):
        for name in ("h", "q", "k", "v"):
            assert g[name].shape == r[name].shape, name
            torch.testing.assert_close(g[name], r[name], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


@needs_native
def test_where_the_decoder_takes_it() -> None:
    """Decode batches up to MAX_ROWS of a float32 Llama layer; not a bigger batch, not
    bfloat16, not a weight laid out otherwise, not a layer with q/k norms; prefill rows
    take the module path."""
    spec = ModelSpec("t", "llama", 2, 4, 2, 40, 36, 50, 64)
    model, _ = _model(spec, 2, seed=0)
    model.pack(2)
    assert model.native_layers
    model.pack(native_layer.MAX_ROWS + 1)
    assert not model.native_layers
    layer = model.layers[0]
    assert native_layer.ok(layer)
    w = layer.mlp.down_proj.weight
    layer.mlp.down_proj.weight.data = w.t().contiguous().t()  # column-major: not row-major
    assert not native_layer.ok(layer)
    layer.mlp.down_proj.weight.data = w.contiguous()
    assert native_layer.ok(layer)
    assert not native_layer.ok(_model(spec, 1, 0)[0].to(torch.bfloat16).layers[0])
    qk = ModelSpec("q", "llama", 2, 4, 2, 40, 36, 50, 64, qk_norm=True)
    assert not native_layer.ok(_model(qk, 1, 0)[0].layers[0])

    model, _ = _model(spec, 2, seed=0)
    calls: list[int] = []
    real = native_layer.pre
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native_layer, "pre", lambda *a: calls.append(1) or real(*a))
        tokens = torch.randint(0, 50, (2, 6))
        model(tokens[:, :5], 0)
        assert calls == []  # the prefill's rows
        model(tokens[:, 5:], 5)
        assert calls == [1, 1]  # each layer's decode rows


@needs_native
def test_a_native_layer_dispatches_only_its_output_buffers() -> None:
    """pre allocates h, q, k and v (four torch ops), post none: the rest is one native call
    each, where the module path dispatches about twenty ops a layer."""
    from kvbench.runtime.opcount import Counting

    spec = ModelSpec("t", "llama", 2, 4, 2, 40, 36, 50, 64)
    model, _ = _model(spec, 2, seed=0)
    model(torch.randint(0, 50, (2, 5)), 0)
    layer, x, a = model.layers[0], torch.randn(2, 1, 40), torch.randn(2, 1, 40)
    with Counting() as c:
        native_layer.pre(layer, x, model._rope, 5)
        native_layer.post(layer, x, a)
    assert c.by_op == {"aten.empty": 3, "aten.empty_like": 1}
    assert c.syncs_by_op == {}
