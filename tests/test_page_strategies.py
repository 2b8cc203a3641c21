"""Quest, ArkVale and InfiniGen against independent references (plain loops over pages and
tokens, float64 softmax), the page digests, and their bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_usage_error, cli

from kvbench.cli import main
from kvbench.models import ModelSpec
from kvbench.runtime.context import Counters, RunContext
from kvbench.strategies._pages import Digests, digest, page_scores
from kvbench.strategies.arkvale import ArkVale, ArkValeParams
from kvbench.strategies.infinigen import InfiniGen, InfiniGenParams
from kvbench.strategies.quest import Quest, QuestParams

# GQA: 6 query heads over 2 KV heads, head dim 8
SPEC = ModelSpec("tiny-gqa", "llama", 3, 6, 2, 48, 96, 100, 512, head_dim=8)
CPU = torch.device("cpu")


def ctx(max_len: int, layers: int = 3, batch: int = 2, device: torch.device = CPU
        ) -> RunContext:
    return RunContext(SPEC, layers, batch, max_len, torch.float32, device, CPU,
                      Counters(SPEC.n_kv_heads, 4, cuda=device.type == "cuda"))


def ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query [D] over keys/values [n, D], float64."""
    w = torch.softmax((k.double() @ q.double()) * q.shape[0] ** -0.5, dim=0)
    return (w[:, None] * v.double()).sum(0)


def test_digests_bound_and_cuboid_mean() -> None:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 2, 37, 8, generator=g)
    q = torch.randn(2, 6, 1, 8, generator=g)
    d = Digests(2, 2, 64, 8, 16, "minmax", CPU, torch.float32)
    d.update(k, 0, 37)
    s = page_scores(q, d.lo[:, :, :3], d.hi[:, :, :3], "query")  # [2, 6, 3]
    for b in range(2):
        for h in range(6):
            for p in range(3):  # the bound holds every key of the page, and is attained
                keys = k[b, h // 3, p * 16:(p + 1) * 16]  # corners: max of q.k over the box
                dots = keys @ q[b, h, 0]
                corner = torch.where(q[b, h, 0] > 0, keys.amax(0), keys.amin(0))
                assert float(dots.max()) <= float(s[b, h, p]) + 1e-5
                assert abs(float(corner @ q[b, h, 0]) - float(s[b, h, p])) < 1e-4
    keys = k[0, 1, 16:32]
    c = (keys.amax(0) + keys.amin(0)) / 2
    r = torch.tensor([sum(abs(float(keys[t, i] - c[i])) for t in range(16)) / 16
                     for i in range(8)])
    lo, hi = digest(keys, "cuboid-mean")
    assert torch.allclose(lo, c - r, atol=1e-6) and torch.allclose(hi, c + r, atol=1e-6)


def _quest_reference(q, k, v, n, budget, page, per_query: bool):
    """Quest decode by loops: score each page by its min/max bound (per query head, or the
    group's sum), keep the current page plus the top others, attend their tokens."""
    b_, hq = q.shape[:2]
    g = hq // k.shape[1]
    n_pages = -(-n // page)
    out = torch.zeros(b_, hq, 8, dtype=torch.float64)
    for b in range(b_):
        for h in range(hq):
            kh = h // g
            heads = [h] if per_query else range(kh * g, kh * g + g)
            scores = []
            for p in range(n_pages - 1):
                keys = k[b, kh, p * page:min(n, (p + 1) * page)]
                scores.append(sum(float(torch.maximum(q[b, x, 0] * keys.amax(0),
                                                      q[b, x, 0] * keys.amin(0)).sum())
                                  for x in heads))
            top = sorted(range(n_pages - 1), key=lambda p: -scores[p])[:budget // page - 1]
            toks = [t for p in [*top, n_pages - 1] for t in range(p * page, min(n, p * page
                                                                                 + page))]
            out[b, h] = ref_attention(q[b, h, 0], k[b, kh, toks], v[b, kh, toks])
    return out


@pytest.mark.parametrize("per", ["query", "kv"])
@pytest.mark.parametrize("native", [True, False])
def test_quest_decode_matches_reference(per: str, native: bool, device: torch.device,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Quest's kernel variant against the reference, its selection in one native call
    (CPU float32) or in torch ops (CUDA, or no native build: forced here); the backend
    the decode notes says which ran."""
    from kvbench.kernels import cpu
    from kvbench.kernels.attention import backend_use

    if not native:
        monkeypatch.setattr(cpu, "page_select_ok", lambda *a: False)
    elif device.type != "cpu" or not cpu.page_select_ok(
            torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8)):
        pytest.skip("the native selection takes CPU float32 with the library built")
    backend_use(reset=True)
    g = torch.Generator().manual_seed(1)
    n0, page, budget = 70, 8, 32
    s = Quest(QuestParams(variant="kernel", budget_tokens=budget, page_size=page,
                          dense_layers=1, topk_per=per), ctx(96, device=device))
    k = torch.randn(2, 2, n0, 8, generator=g)
    v = torch.randn(2, 2, n0, 8, generator=g)
    s.prefill(1, torch.randn(2, 6, n0, 8, generator=g).to(device), k.to(device), v.to(device))
    for _ in range(3):  # three decode steps, crossing into a new page
        kn, vn = torch.randn(2, 2, 1, 8, generator=g), torch.randn(2, 2, 1, 8, generator=g)
        q = torch.randn(2, 6, 1, 8, generator=g)
        out = s.decode(1, q.to(device), kn.to(device), vn.to(device)).cpu()
        k, v = torch.cat([k, kn], 2), torch.cat([v, vn], 2)
        ref = _quest_reference(q, k, v, k.shape[2], budget, page, per == "query")
        assert torch.allclose(out[:, :, 0].double(), ref, atol=1e-5)
    assert ("native-select" in backend_use(reset=True).get("decode", "").split("+")) == native
    # layer 0 is dense (--dense-layers 1): it attends every token
    s.prefill(0, torch.randn(2, 6, n0, 8, generator=g).to(device), k[:, :, :n0].to(device),
              v[:, :, :n0].to(device))
    s.ctx.counters.layer = 0
    s.decode(0, q.to(device), k[:, :, -1:].to(device), v[:, :, -1:].to(device))
    assert s.ctx.counters.step_total("tokens", "accel", 0) > 0


@pytest.mark.parametrize(("per", "sinks", "window"), [("query", 1, 2), ("kv", 2, 1)])
def test_quest_torch_selection_equals_the_native_one(per: str, sinks: int, window: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch selection (CUDA's, or without the native build) keeps the same pages and
    attends the same tokens as the native call, sinks and window forced in."""
    from kvbench.kernels import cpu

    if cpu._lib() is None:
        pytest.skip("native library not built")
    runs = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(cpu, "page_select_ok", lambda *a: False)
        g = torch.Generator().manual_seed(4)
        s = Quest(QuestParams(variant="kernel", budget_tokens=40, page_size=4, dense_layers=0,
                              topk_per=per, sinks=sinks, window_pages=window), ctx(96))
        s.prefill(0, torch.randn(2, 6, 70, 8, generator=g), torch.randn(2, 2, 70, 8, generator=g),
                  torch.randn(2, 2, 70, 8, generator=g))
        outs = [s.decode(0, torch.randn(2, 6, 1, 8, generator=g),
                         torch.randn(2, 2, 1, 8, generator=g),
                         torch.randn(2, 2, 1, 8, generator=g)) for _ in range(3)]
        runs.append((outs, s.last[0]))
    (a, (pa, la)), (b, (pb, lb)) = runs
    assert torch.equal(la, lb) and torch.equal(pa, pb)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)


class _Model:
    """Stands in for the decoder: `query` returns the predicted query it was given."""

    def __init__(self) -> None:
        self.q: torch.Tensor | None = None

    def query(self, layer: int, x: torch.Tensor, start: int) -> torch.Tensor:
        return self.q


@pytest.mark.parametrize("max_per", ["head", "head0"])
def test_infinigen_speculation_matches_reference(max_per: str, device: torch.device) -> None:
    """r = 1: partial scores are the exact scores (A is orthogonal), so the prefetched set is
    each head's top n' by q_pred.k, n' = min(mean count within alpha of the max, cap)."""
    g = torch.Generator().manual_seed(3)
    c = ctx(64, layers=2, device=device)
    c.model = _Model()
    alpha = 1.0
    s = InfiniGen(InfiniGenParams(variant="oracle", alpha=alpha, partial_ratio=1.0,
                                  dense_layers=1, max_per=max_per, budget_tokens=12,
                                  skew_tokens=40), c)
    n0 = 40
    k = torch.randn(2, 2, n0, 8, generator=g)
    v = torch.randn(2, 2, n0, 8, generator=g)
    s.prefill(1, torch.randn(2, 6, n0, 8, generator=g).to(device), k.to(device), v.to(device))
    pred = torch.randn(2, 6, 1, 8, generator=g)
    c.model.q = pred.to(device)
    s.layer_input(0, torch.zeros(2, 1, 48, device=device))
    q = pred + 0.3 * torch.randn(2, 6, 1, 8, generator=g)  # the real query differs
    kn, vn = torch.randn(2, 2, 1, 8, generator=g), torch.randn(2, 2, 1, 8, generator=g)
    out = s.decode(1, q.to(device), kn.to(device), vn.to(device)).cpu()
    logits = torch.einsum("bhd,bhnd->bhn", pred[:, :, 0], k.repeat_interleave(3, 1)) / 8 ** .5
    top = logits.amax(-1, keepdim=True)
    if max_per == "head0":
        top = top[:, :1].expand_as(top)
    n_sel = min(int((logits >= top - alpha).sum(-1).float().mean()), 12)
    assert n_sel >= 1
    for b in range(2):
        for h in range(6):
            toks = logits[b, h].topk(n_sel).indices
            kk = torch.cat([k[b, h // 3, toks], kn[b, h // 3]])
            vv = torch.cat([v[b, h // 3, toks], vn[b, h // 3]])
            ref = ref_attention(q[b, h, 0], kk, vv)
            assert torch.allclose(out[b, h, 0].double(), ref, atol=1e-5)
    assert c.counters.step_total("bytes_moved", "h2d", 0) == 2 * 2 * 6 * n_sel * 8 * 4


def test_infinigen_skew_is_orthogonal_and_keeps_the_heaviest_channels() -> None:
    from kvbench.strategies._infinigen_calib import skew

    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 6, 50, 8, generator=g) * torch.linspace(0.1, 3, 8)
    k = torch.randn(1, 2, 50, 8, generator=g)
    a, ch = skew(q, 2, 0.25)
    assert a.shape == (2, 8, 8) and ch.shape == (2, 2)
    assert torch.allclose(a @ a.transpose(1, 2), torch.eye(8).expand(2, 8, 8), atol=1e-5)
    for h in range(6):  # q A . k A == q . k within each group
        qa, ka = q[0, h] @ a[h // 3], k[0, h // 3] @ a[h // 3]
        assert torch.allclose(qa @ ka.T, q[0, h] @ k[0, h // 3].T, atol=1e-4)
    for j in range(2):
        mass = (q[0, 3 * j:3 * j + 3].reshape(-1, 8) @ a[j]).abs().sum(0)
        assert set(ch[j].tolist()) == set(mass.topk(2).indices.tolist())
    short = skew(q[:, :, :2], 2, 0.5)[0]  # 6 query rows per group < D = 8: still square
    assert torch.allclose(short @ short.transpose(1, 2), torch.eye(8).expand(2, 8, 8),
                          atol=1e-5)


@pytest.mark.parametrize("args, message", [
    (["quest", "--budget-tokens", "8"], "smaller than one page of 16 tokens"),
    (["quest", "--page-size", "0"], "--page-size 0: must be at least 1"),
    (["arkvale", "--budget-tokens", "16"], "smaller than one page of 32 tokens"),
    (["arkvale", "--budget-tokens", "64"], "exceed the budget of 2 pages"),
    (["infinigen", "--partial-ratio", "0"], "--partial-ratio 0.0: must be in (0, 1]"),
    (["infinigen", "--partial-ratio", "1.5"], "--partial-ratio 1.5: must be in (0, 1]"),
    (["infinigen", "--alpha", "-1"], "--alpha -1.0: must be >= 0"),
    (["quest", "--dense-layers", "40"], "--dense-layers 40: the model runs 30 layers"),
    (["infinigen", "--dense-layers", "31"], "--dense-layers 31: the model runs 30 layers"),
    (["arkvale", "--dense-layers", "31"], "--dense-layers 31: the model runs 30 layers"),
])
def test_bad_input_exits_2(args: list[str], message: str, capsys, tmp_path: Path) -> None:
    assert_usage_error(cli(["run", *args, "--model", "smollm2-135m", "--weights", "random",
                            "--prompt-len", "40", "--gen-len", "4", "--out",
                            str(tmp_path / "x.jsonl")], capsys), message)
    assert not (tmp_path / "x.jsonl").exists()


def test_budget_beyond_context_is_exact_not_an_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        main(["run", "quest", "--budget-tokens", "100000", "--model", "smollm2-135m",
              "--weights", "random", "--layers", "3", "--prompt-len", "40", "--gen-len", "4",
              "--out", str(tmp_path / "x.jsonl")])
    assert e.value.code == 0


def test_attended_masks_count_what_was_attended() -> None:
    """Strategy.attended marks as many positions per head as the step counted tokens."""
    from kvbench.strategies.h2o import H2O, H2OParams
    from kvbench.strategies.streaming import Streaming, StreamingParams

    g = torch.Generator().manual_seed(5)
    made = [Quest(QuestParams(variant="kernel", budget_tokens=32, page_size=8,
                              dense_layers=0), ctx(96)),
            ArkVale(ArkValeParams(budget_tokens=24, page_size=4, pages=4, sinks=1,
                                  window_pages=2, dense_layers=0), ctx(96)),
            H2O(H2OParams(gpu_tokens=20), ctx(96)),
            Streaming(StreamingParams(gpu_tokens=20), ctx(96))]
    k = torch.randn(2, 2, 60, 8, generator=g)
    for s in made:
        s.prefill(0, torch.randn(2, 6, 60, 8, generator=g), k, k.clone())
        s.ctx.counters.step = 1
        s.decode(0, torch.randn(2, 6, 1, 8, generator=g), k[:, :, :1], k[:, :, :1])
        mask = s.attended(0)
        assert mask.shape == (2, 6, 61) and mask[:, :, -1].all()  # the new token
        counted = s.ctx.counters.step_total("tokens", "accel", 1) / 2  # per sequence
        assert abs(float(mask.sum(-1).float().mean()) - counted) < 1e-6, type(s).__name__
        assert not mask.all()  # the budget left some out


def test_shadow_counts_top10_recall() -> None:
    """Eval mode: the share of full attention's top-10 keys a streaming window kept,
    against a direct computation."""
    from kvbench.runtime.shadow import Shadow
    from kvbench.strategies.streaming import Streaming, StreamingParams

    g = torch.Generator().manual_seed(6)
    c = ctx(96)
    s = Shadow(Streaming(StreamingParams(gpu_tokens=24, sinks=4), c), c)
    k = torch.randn(2, 2, 50, 8, generator=g)
    s.prefill(0, torch.randn(2, 6, 50, 8, generator=g), k, k.clone())
    c.counters.step = 1
    q = torch.randn(2, 6, 1, 8, generator=g)
    kn = torch.randn(2, 2, 1, 8, generator=g)
    s.decode(0, q, kn, kn.clone())
    s.flush()
    kk = torch.cat([k, kn], 2).repeat_interleave(3, 1)
    best = (q @ kk.transpose(-1, -2)).squeeze(2).topk(10, dim=-1).indices
    kept = (best < 4) | (best >= 51 - 20)
    got = c.counters.step_total("topk_recall", "attention", 1)
    assert abs(got - float(kept.float().mean())) < 1e-6 and 0 < got < 1


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["quest", "arkvale", "infinigen"])
def test_cuda_exact_setting_equals_full(name: str) -> None:
    """On a GPU (bfloat16 would hide small errors: float32): the exact setting's NLLs equal
    full attention's, through the CUDA paths (pinned host KV, side-stream prefetch)."""
    import dataclasses

    from kvbench.models.weights import load
    from kvbench.runtime.run import decode_run
    from kvbench.strategies import STRATEGIES

    cuda = torch.device("cuda")
    spec = ModelSpec("tiny-gqa", "llama", 3, 6, 2, 48, 96, 100, 512, head_dim=8)
    model = load(spec, "random", 3, torch.float32, cuda, seed=1).model
    rows = torch.randint(0, 100, (2, 90), generator=torch.Generator().manual_seed(0)).to(cuda)
    nll = {}
    for n in ("full", name):
        c = RunContext(spec, 3, 2, 90, torch.float32, cuda, CPU, Counters(2, 4, cuda=True),
                       model)
        cls = STRATEGIES.get(n)
        params = dataclasses.replace(cls.params(), **dict(cls.exact)) if cls.exact else None
        if n != "full" and "dense_layers" in {f.name for f in dataclasses.fields(cls.params)}:
            params = dataclasses.replace(params, dense_layers=1)
        s = cls(params, c)
        model.setup(s, c.counters, 90)
        nll[n] = decode_run(model, s, rows, 40, "eval", torch.cuda.synchronize).nll
    assert max(abs(a - b) for a, b in zip(nll["full"], nll[name], strict=True)) < 1e-4


def test_infinigen_attends_densely_until_its_skew_warm_up() -> None:
    """Skewing from the first --skew-tokens queries: before them the layer attends every
    token; after them it speculates, its partial keys covering every cached token."""
    g = torch.Generator().manual_seed(7)
    c = ctx(64, layers=2)
    c.model = _Model()
    s = InfiniGen(InfiniGenParams(variant="oracle", dense_layers=1, skew_tokens=22,
                                  budget_tokens=4), c)
    k = torch.randn(2, 2, 20, 8, generator=g)
    s.prefill(1, torch.randn(2, 6, 20, 8, generator=g), k, k.clone())
    for step in (1, 2, 3):
        c.model.q = torch.randn(2, 6, 1, 8, generator=g)
        s.layer_input(0, torch.zeros(2, 1, 48))
        c.counters.step = step
        c.counters.layer = 1
        s.decode(1, c.model.q, k[:, :, :1], k[:, :, :1])
        mask = s.attended(1)
        # steps 1-2: 21, 22 queries seen, skewed at the end of step 2; step 3 speculates
        assert bool(mask.all()) == (step < 3), step
    assert s.skew[1] is not None
    assert torch.allclose(s.part[1][:, :, :22].float(),
                          s._partial(1, s.host_k[1][:22].permute(1, 2, 0, 3)), atol=1e-6)


@pytest.mark.parametrize("spread", [1.0, 2.0])
def test_infinigen_default_partial_ratio_matches_a_float64_reference(
        spread: float, device: torch.device) -> None:
    """Issue 30: InfiniGen at its defaults (partial ratio 0.2: d' = 4 of 20 channels, alpha
    5, cap 0.2 of the cached tokens) over 6 decode steps, batch 2, against a float64
    reference: A from the SVD of each group's prompt queries (right singular vectors), the
    4 channels of largest sum |q A|, partial scores (q A)[c] . (k A)[c] / sqrt(D) of the
    predicted query, n' = max(1, min(mean count within alpha of the head's max, cap)), each
    head's top n' tokens plus the new one attended by the real query. The speculated tokens
    and the outputs equal the reference's at every step. Keys at spread 1 leave most
    tokens within alpha (the cap decides n': 8, 9), at spread 2 few (alpha decides)."""
    from kvbench.models import ModelSpec

    spec = ModelSpec("tiny-gqa-20", "llama", 2, 6, 2, 48, 96, 100, 512, head_dim=20)
    c = RunContext(spec, 2, 2, 64, torch.float32, device, CPU,
                   Counters(spec.n_kv_heads, 4, cuda=device.type == "cuda"))
    c.model = _Model()
    p, d, b, hq, hkv = 40, 20, 2, 6, 2
    s = InfiniGen(InfiniGenParams(variant="oracle", dense_layers=1, skew_tokens=p), c)
    assert s.dp == 4 and s.p.partial_ratio == 0.2 and s.p.alpha == 5.0
    g = torch.Generator().manual_seed(11)
    scales = torch.linspace(0.3, 3.0, d)
    q0 = torch.randn(b, hq, p, d, generator=g) * scales
    k = torch.randn(b, hkv, p, d, generator=g) * scales * spread
    v = torch.randn(b, hkv, p, d, generator=g)
    s.prefill(1, q0.to(device), k.to(device), v.to(device))
    # the reference's skew, float64, one A and 4 channels per KV head from its 3 heads
    a, ch = [], []
    for h in range(hkv):
        qs = torch.cat([q0[bi, 3 * h + j].double() for bi in range(b) for j in range(3)])
        ah = torch.linalg.svd(qs, full_matrices=False).Vh.T
        a.append(ah)
        ch.append((qs @ ah).abs().sum(0).topk(4).indices)
    ks, vs = k.double(), v.double()
    sizes = set()
    for step in range(1, 7):
        n = ks.shape[2]
        pred = torch.randn(b, hq, 1, d, generator=g) * scales
        q = pred + 0.3 * torch.randn(b, hq, 1, d, generator=g)
        kn = torch.randn(b, hkv, 1, d, generator=g) * scales * spread
        vn = torch.randn(b, hkv, 1, d, generator=g)
        c.model.q = pred.to(device)
        c.counters.step = step
        s.layer_input(0, torch.zeros(b, 1, 48, device=device))
        out = s.decode(1, q.to(device), kn.to(device), vn.to(device)).cpu()
        logits = torch.empty(b, hq, n, dtype=torch.float64)
        for bi in range(b):
            for qh in range(hq):
                h = qh // 3
                pq = (pred[bi, qh, 0].double() @ a[h])[ch[h]]
                pk = (ks[bi, h] @ a[h])[:, ch[h]]
                logits[bi, qh] = pk @ pq / d ** 0.5
        count = (logits >= logits.amax(-1, keepdim=True) - 5.0).sum(-1).double().mean()
        n_sel = max(1, min(int(count), max(1, int(0.2 * n)), n))
        sizes.add(n_sel)
        chosen = s.chosen[1]
        assert chosen is not None and chosen.shape == (b, hq, n_sel), step
        for bi in range(b):
            for qh in range(hq):
                h = qh // 3
                toks = logits[bi, qh].topk(n_sel).indices
                assert set(chosen[bi, qh].tolist()) == set(toks.tolist()), (step, bi, qh)
                ref = ref_attention(q[bi, qh, 0], torch.cat([ks[bi, h, toks], kn[bi, h]]),
                                    torch.cat([vs[bi, h, toks], vn[bi, h]]))
                assert torch.allclose(out[bi, qh, 0].double(), ref, atol=1e-5), step
        ks, vs = torch.cat([ks, kn.double()], 2), torch.cat([vs, vn.double()], 2)
    assert sizes == {8, 9} if spread == 1.0 else max(sizes) < 8
