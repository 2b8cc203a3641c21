"""InfiniGen's decode steps through the whole model (issue 30): what each layer's step files
in the counters, computed in the test from the sizes the step chose (dense layers read
every cached token, sparse ones the prefetched tokens and the new one, the speculation its
partial keys, the prefetch its gathered rows as a look-ahead copy), the mask it reports, the
speculation's gating and count rule, the partial channels, and the dense path's output
against full attention."""

from __future__ import annotations

import pytest
import torch

from kvbench.models import ModelSpec
from kvbench.models.weights import load
from kvbench.runtime.context import Counters, RunContext
from kvbench.runtime.run import decode_run
from kvbench.strategies.full import Full
from kvbench.strategies.infinigen import InfiniGen, InfiniGenParams

CPU = torch.device("cpu")
SPEC = ModelSpec("tiny-gqa-4l", "llama", 4, 6, 2, 48, 96, 100, 160, head_dim=20)
B, HQ, HKV, D, P, STEPS = 2, 6, 2, 20, 24, 3


def _run(params: InfiniGenParams | None, mode: str = "generate",
         dtype: torch.dtype = torch.float32):
    """A run of `params` (None: full attention) on the 4-layer model: (strategy, counters,
    outcome)."""
    model = load(SPEC, "random", 4, dtype, CPU, seed=3).model
    elem = torch.finfo(dtype).bits // 8
    c = Counters(SPEC.n_kv_heads, elem, False, 4)
    n = P + STEPS + 1
    ctx = RunContext(SPEC, 4, B, n, dtype, CPU, CPU, c, model)
    s = Full(Full.params(), ctx) if params is None else InfiniGen(params, ctx)
    model.setup(s, c, n)
    g = torch.Generator().manual_seed(4)
    rows = torch.randint(0, SPEC.vocab, (B, n if mode == "eval" else P), generator=g)
    return s, c, decode_run(model, s, rows, STEPS, mode, lambda: None)


def _by_layer(c: Counters, quantity: str, where: str, step: int) -> dict[int, float]:
    return {layer: v.get(step, 0.0) for q, w, layer, v in c.series()
            if q == quantity and w == where}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_layer_files_the_work_of_what_it_chose(dtype: torch.dtype) -> None:
    """The last step (n = P + 3 tokens with the new one): layer 0 dense (every token read
    back from the host and attended), layers 1-3 sparse (the n' prefetched tokens per query
    head and the new one, K and V per query head); the speculation of layer L at layer L-1's
    input scores the n - 1 cached partial keys; the prefetch of layer L's rows is filed at
    layer L-1 as a copy that layer L's attention waits for, off the chain."""
    s, c, _ = _run(InfiniGenParams(variant="oracle", budget_tokens=5, dense_layers=1,
                                   skew_tokens=8), dtype=dtype)
    elem = torch.finfo(dtype).bits // 8
    n, step = P + STEPS, STEPS
    sel = {layer: s.chosen[layer].shape[2] for layer in (1, 2, 3)}
    assert all(1 <= v <= 5 for v in sel.values())
    w = {layer: s.part[layer].shape[3] for layer in (1, 2, 3)}
    tokens = _by_layer(c, "tokens", "accel", step)
    flops = _by_layer(c, "flops", "accel", step)
    read = _by_layer(c, "bytes_read", "accel", step)
    h2d = _by_layer(c, "bytes_moved", "h2d", step)
    assert tokens[0] == B * n
    assert flops[0] == 4.0 * B * HQ * n * D + 2.0 * B * HQ * (n - 1) * w[1]
    assert read[0] == 2.0 * B * HKV * n * D * elem + B * HKV * (n - 1) * w[1] * elem
    assert h2d[0] == 2.0 * B * HKV * n * D * elem + 2.0 * B * HQ * sel[1] * D * elem
    for layer in (1, 2, 3):
        m = sel[layer] + 1
        spec = layer + 1 < 4  # layer L speculates for L + 1 at its input
        assert tokens[layer] == B * m
        assert flops[layer] == 4.0 * B * HQ * m * D + (
            2.0 * B * HQ * (n - 1) * w[layer + 1] if spec else 0.0)
        assert read[layer] == 2.0 * B * HQ * m * D * elem + (
            B * HKV * (n - 1) * w[layer + 1] * elem if spec else 0.0)
        assert h2d.get(layer, 0.0) == (2.0 * B * HQ * sel[layer + 1] * D * elem if spec
                                       else 0.0)
        mask = s.attended(layer)
        assert mask.dtype == torch.bool and tuple(mask.shape) == (B, HQ, n)
        assert bool((mask.sum(-1) == m).all()) and bool(mask[:, :, n - 1].all())
    assert s.attended(0).dtype == torch.bool and bool(s.attended(0).all())
    assert tuple(s.attended(0).shape) == (B, HQ, n)
    speculate = _by_layer(c, "time", "bookkeeping.speculate", step)
    assert {0, 1, 2} <= set(speculate) and all(speculate[layer] > 0 for layer in (0, 1, 2))
    # the speculation (at a layer's input) and its gather and prefetch (after the layer's
    # attention) are one phase; nothing else is timed apart from attention
    assert {w for q, w, _, _ in c.series() if q == "time"} == {"attention",
                                                               "bookkeeping.speculate"}
    # the prefetch is a look-ahead copy: the attention of the next layer waits for it
    tasks = [t for t in c.graph.tasks if t.step == step]
    for layer in (0, 1, 2):
        (copy,) = [t for t in tasks if t.layer == layer and t.op == "copy"
                   and t.resource == "h2d" and t.work["bytes_moved"]
                   == 2.0 * B * HQ * sel[layer + 1] * D * elem]
        (att,) = [t for t in tasks if t.layer == layer + 1 and t.op == "attention"]
        assert copy.id in att.after
        assert att.work["bytes_written"] == B * HQ * D * elem  # the query's, as the output
        assert not any(copy.id in t.after for t in tasks if t.layer == layer)
    assert s.fetched.get(1) is None and s.chosen[1].dtype == torch.int64


def test_the_count_rule_sets_how_many_tokens_each_head_fetches() -> None:
    """n' = max(1, min(count, cap, n)): the oracle's mean count over heads; a cap of 1
    fetches one token per head."""
    s, *_ = _run(InfiniGenParams(variant="oracle", budget_tokens=12, alpha=2.0,
                                 dense_layers=1, skew_tokens=8))
    n = P + STEPS - 1  # cached at the last speculation (layer 3's)
    assert s.chosen[3].shape[2] == max(1, min(int(s.count[0]), 12, n))
    s, *_ = _run(InfiniGenParams(variant="oracle", budget_tokens=1, dense_layers=1,
                                 skew_tokens=8))
    assert {s.chosen[layer].shape[2] for layer in (1, 2, 3)} == {1}


def test_the_authors_speculate_from_the_cap_on_and_fetch_one_more(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """authors (cap 25 of the 28-token run, alpha 0: the tokens at or above head 0's
    maximum): rows below the cap (step 1, 24 cached) attend every token; from the cap on
    (step 2, 25 cached) a speculation fetches n' = count + 1 (the current token may take a
    place), its partial query with the padding zeroed."""
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    queries: list[object] = []
    partial = InfiniGen._partial

    def spy(self, layer, x, query=False):
        queries.append(query) if x.shape[1] == HQ and x.shape[2] == 1 else None
        return partial(self, layer, x, query)

    monkeypatch.setattr(InfiniGen, "_partial", spy)
    s, c, _ = _run(InfiniGenParams(budget_tokens=25, alpha=0.0, dense_layers=1))
    assert queries and set(queries) == {True}
    for layer in (1, 2, 3):
        assert _by_layer(c, "tokens", "accel", 1)[layer] == B * (P + 1)  # below the cap
        assert _by_layer(c, "tokens", "accel", 2)[layer] < B * (P + 2)
    n = P + STEPS - 1
    assert 1 <= int(s.count[0]) < 24  # below the cap: the one more shows
    assert s.chosen[3].shape[2] == max(1, min(int(s.count[0]) + 1, 25, n))
    assert {w for q, w, _, _ in c.series() if q == "time"} == {"attention",
                                                               "bookkeeping.speculate"}


def test_every_dense_layer_is_full_attention() -> None:
    """With every layer dense InfiniGen reads the whole cache back and attends it: the
    same per-token losses as full attention."""
    *_, ours = _run(InfiniGenParams(variant="oracle", dense_layers=4), mode="eval")
    *_, full = _run(None, mode="eval")
    assert ours.nll == pytest.approx(full.nll, rel=1e-5, abs=1e-6)


def test_the_partial_channels_and_their_padding() -> None:
    """x [B, H, T, D] times the head's skew, its channels gathered; a query's padding
    channel (use 0) zeroed, a key's kept (the product with the query's zero is 0 anyway)."""
    model = load(SPEC, "random", 4, torch.float32, CPU, seed=3).model
    ctx = RunContext(SPEC, 4, B, 32, torch.float32, CPU, CPU, Counters(HKV, 4), model)
    s = InfiniGen(InfiniGenParams(variant="oracle", dense_layers=1), ctx)
    g = torch.Generator().manual_seed(9)
    a = torch.randn(HKV, D, D, generator=g)
    ch = torch.tensor([[3, 1, 7], [0, 5, 2]])
    on = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    s.skew[2] = (a, ch, on)
    x = torch.randn(B, HQ, 4, D, generator=g)
    want = torch.stack([(x[:, h] @ a[h // 3])[..., ch[h // 3]] for h in range(HQ)], 1)
    assert torch.allclose(s._partial(2, x), want)
    zeroed = want.clone()
    zeroed[:, :3, :, 2] = 0.0
    assert torch.equal(s._partial(2, x, query=True), zeroed)
    keys = torch.randn(B, HKV, 4, D, generator=g)
    assert torch.allclose(s._partial(2, keys), torch.stack(
        [(keys[:, h] @ a[h])[..., ch[h]] for h in range(HKV)], 1))


def test_the_oracle_cap_and_when_a_speculation_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle's cap is 0.2 of the cached tokens, at least 1; a speculation runs for a
    sparse next layer at a one-token input only, with the next layer's query at the
    current position."""
    model = load(SPEC, "random", 4, torch.float32, CPU, seed=3).model
    ctx = RunContext(SPEC, 4, B, 32, torch.float32, CPU, CPU, Counters(HKV, 4), model)
    s = InfiniGen(InfiniGenParams(variant="oracle", dense_layers=2, skew_tokens=4), ctx)
    assert (s.cap(4), s.cap(5), s.cap(20)) == (1, 1, 4)
    g = torch.Generator().manual_seed(1)
    for layer in range(4):
        k = torch.randn(B, HKV, 10, D, generator=g)
        s.prefill(layer, torch.randn(B, HQ, 10, D, generator=g), k, k)
    calls: list[tuple] = []
    query = model.query
    monkeypatch.setattr(model, "query", lambda *a: calls.append(a) or query(*a))
    one = torch.randn(B, 1, SPEC.hidden, generator=g)
    for layer, x in ((0, one), (1, torch.randn(B, 2, SPEC.hidden, generator=g)), (3, one)):
        s.layer_input(layer, x)  # layer 1 is dense; a prompt input; no layer after 3
        assert s.queued is None and calls == []
    s.layer_input(2, one)
    assert s.queued is not None and s.queued[0] == 3 and s.queued[3] == 10
    assert len(calls) == 1 and calls[0][0] == 3 and calls[0][1] is one and calls[0][2] == 10


@pytest.mark.parametrize("native", [True, False])
def test_the_speculations_selection_and_top_k_are_noted(
        native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sparse decode steps select in torch ops (the speculation's scores) and their top
    n'_max in one native call on the CPU ("native-topk"; torch's where the library is not
    there), and every record's method.backend says so beside the attention's backend; the
    two top-k paths decode the same tokens."""
    from kvbench.kernels import cpu
    from kvbench.kernels.attention import backend_use

    if not native:
        monkeypatch.setattr(cpu, "topk_ok", lambda *a: False)
    backend_use(reset=True)
    params = InfiniGenParams(variant="oracle", budget_tokens=5, dense_layers=1, skew_tokens=8)
    _, _, out = _run(params)
    used = backend_use(reset=True)["decode"].split("+")
    assert "torch-select" in used and ("native-topk" in used) == native
    monkeypatch.undo()
    assert torch.equal(_run(params)[2].tokens, out.tokens)
