"""Multi-turn runs: the decoder's append dispatch, appends of full, offload, h2o and
streaming against one long single-turn run, h2o's and streaming's caches after an append,
the runtime's sequence layout and records, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvbench.cli import main
from kvbench.errors import KvbenchError
from kvbench.kernels.attention import dense_attention
from kvbench.models import ModelSpec
from kvbench.runtime.context import Counters, RunContext
from kvbench.runtime.run import Outcome, RunConfig, decode_run
from kvbench.strategies import STRATEGIES, NoParams, Strategy, supports_append
from kvbench.strategies.full import Full
from kvbench.strategies.h2o import H2OParams
from kvbench.strategies.hgca import HgcaParams
from kvbench.strategies.streaming import StreamingParams

# GQA (4 query heads over 2 KV heads), RoPE, head dim 16, 100-token vocabulary
SPEC = ModelSpec("tiny-gqa", "llama", 2, 4, 2, 64, 128, 100, 256, head_dim=16)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one torch thread (several only contend on a small shared machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    """Random tiny decoder with weights scaled to std 0.15: sharp attention and logits,
    so a wrong attention shows in the NLLs."""
    from kvbench.models.weights import load

    m = load(SPEC, "random", 2, torch.float32, CPU, seed=1).model
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.mul_(7.5)
    return m


def context(max_len: int, batch: int = 2, layers: int = 2, accel: torch.device = CPU
            ) -> RunContext:
    return RunContext(SPEC, layers, batch, max_len, torch.float32, accel, CPU,
                      Counters(SPEC.n_kv_heads, 4, cuda=accel.type == "cuda"))


def run(model, name: str, params, rows: torch.Tensor, p: int, g: int, mode: str,
        turns: int) -> Outcome:
    """decode_run of `turns` turns under strategy `name`, on the device of rows [B, L]."""
    ctx = context(turns * (p + g + 1), rows.shape[0], accel=rows.device)
    ctx.model = model
    strategy = STRATEGIES.get(name)(params, ctx)
    model.setup(strategy, ctx.counters, ctx.max_len)
    sync = torch.cuda.synchronize if rows.is_cuda else lambda: None
    return decode_run(model, strategy, rows, g, mode, sync, turns=turns)


def test_decoder_dispatches_prefill_decode_append(model) -> None:
    """start 0 -> prefill, one token -> decode, several tokens later -> append."""
    calls = []

    class Recorder(Full):
        def prefill(self, layer, q, k, v):
            calls.append(("prefill", layer, q.shape[2]))
            return super().prefill(layer, q, k, v)

        def decode(self, layer, q, k, v):
            calls.append(("decode", layer, q.shape[2]))
            return super().decode(layer, q, k, v)

        def append(self, layer, q, k, v):
            calls.append(("append", layer, q.shape[2]))
            return super().append(layer, q, k, v)

    ctx = context(16, batch=1)
    model.setup(Recorder(NoParams(), ctx), ctx.counters, 16)
    tokens = torch.randint(0, 100, (1, 9))
    model(tokens[:, :5], 0)
    model(tokens[:, 5:6], 5)
    model(tokens[:, 6:9], 6)
    assert calls == [("prefill", 0, 5), ("prefill", 1, 5), ("decode", 0, 1), ("decode", 1, 1),
                     ("append", 0, 3), ("append", 1, 3)]


@pytest.mark.parametrize("name, params, p", [
    ("full", NoParams(), 12),  # appends of 13 tokens: the native CPU kernel's causal q_start
    ("full", NoParams(), 36),  # appends of 37 tokens: the torch path
    ("offload", NoParams(), 12),
    ("h2o", H2OParams(gpu_share=1.0), 12),
    ("streaming", StreamingParams(gpu_share=1.0), 12),
])
def test_multiturn_nll_equals_one_long_full_run(model, name, params, p) -> None:
    """3 teacher-forced turns: every scored prediction's NLL equals that of the same
    position in one single-turn full run over the whole sequence (1e-4 relative)."""
    g, turns, b = 5, 3, 2
    n = p + g + 1
    rows = torch.randint(0, 100, (b, turns * n), generator=torch.Generator().manual_seed(0))
    ref = run(model, "full", NoParams(), rows, p, turns * n - p - 1, "eval", 1).nll
    got = run(model, name, params, rows, p, g, "eval", turns)
    assert len(got.appends) == turns - 1 and len(got.steps) == turns * g
    scored = [k * n + p + j for k in range(turns) for j in range(g + 1)]
    expect = [ref[(pos - p) * b + i] for pos in scored for i in range(b)]
    torch.testing.assert_close(torch.tensor(got.nll), torch.tensor(expect), rtol=1e-4, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name, params", [
    ("offload", NoParams()),  # side-stream prefetches, pinned host cache
    ("h2o", H2OParams(gpu_share=1.0)),
    ("streaming", StreamingParams(gpu_share=1.0)),
    ("hgca", HgcaParams(gpu_tokens=8, block=4, beta=0.0)),  # side-stream MAW and evictions
])
def test_cuda_multiturn_equals_full(model, name, params) -> None:
    """On a GPU (float32): 3-turn eval NLLs of each strategy equal full attention's (hgca
    at beta 0: every host entry attended, the ring wrapping within each turn)."""
    import copy

    m = copy.deepcopy(model).to("cuda")
    p, g, turns = 12, 5, 3
    rows = torch.randint(0, 100, (2, turns * (p + g + 1)), device="cuda")
    ref = run(m, "full", NoParams(), rows, p, g, "eval", turns).nll
    got = run(m, name, params, rows, p, g, "eval", turns).nll
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=0)


def test_h2o_small_budget_differs_from_full(model) -> None:
    """The comparison above is sensitive: h2o at 30% of the KV does not reproduce full."""
    p, g, turns = 12, 5, 3
    rows = torch.randint(0, 100, (2, turns * (p + g + 1)),
                         generator=torch.Generator().manual_seed(0))
    full = torch.tensor(run(model, "full", NoParams(), rows, p, g, "eval", turns).nll)
    h2o = torch.tensor(run(model, "h2o", H2OParams(gpu_share=0.3), rows, p, g, "eval", turns).nll)
    assert float(((h2o - full).abs() / full).max()) > 1e-3


def test_generate_turn_prompts_come_from_the_rows(model) -> None:
    """Generate mode: turn k's prompt is rows[:, kP:(k+1)P], the rest greedy tokens; the
    first turn generates what a single-turn run generates."""
    p, g, turns = 8, 4, 3
    rows = torch.randint(0, 100, (2, turns * p), generator=torch.Generator().manual_seed(2))
    out = run(model, "full", NoParams(), rows, p, g, "generate", turns)
    seq = out.tokens.view(2, turns, p + g + 1)
    assert torch.equal(seq[:, :, :p], rows.view(2, turns, p))
    single = run(model, "full", NoParams(), rows[:, :p], p, g, "generate", 1).tokens
    assert torch.equal(seq[:, 0], single)


def _qkv(t: int, batch: int = 1, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, h, t, SPEC.head_dim, generator=gen)
                 for h in (SPEC.n_heads, SPEC.n_kv_heads, SPEC.n_kv_heads))


def test_h2o_append_keeps_budget_recent_and_heavy_hitters() -> None:
    """After decode steps (one slot per row freed), an append attends to exactly the kept
    tokens plus the new ones (causal), adds the new queries' attention to the scores and
    keeps per row the budget: the 10 latest positions and the 10 best-scoring others."""
    s = STRATEGIES.get("h2o")(H2OParams(gpu_share=0.25, recent=0.5), context(80, 1, 1))
    assert (s.budget, s.n_recent) == (20, 10)
    e = torch.zeros(SPEC.head_dim)
    e[0] = 1.0
    q0, k0, v0 = _qkv(30)
    q0 += 3 * e
    k0[:, :, 5] = 10 * e  # a heavy hitter for every query
    k0[:, :, 15] = -10 * e  # ignored by every query
    ks, vs = [k0], [v0]
    s.prefill(0, q0, k0, v0)
    for i in range(6):
        q, k, v = _qkv(1, seed=10 + i)
        s.decode(0, q + 3 * e, k, v)
        ks.append(k)
        vs.append(v)
    kall, vall = torch.cat(ks, dim=2), torch.cat(vs, dim=2)  # 36 tokens seen
    free = s.free[0]
    kept = [[int(t) for j, t in enumerate(s.pos[0][0, h, :s.n[0]]) if j != int(free[0, h])]
            for h in range(2)]
    before = {h: {int(t): float(sc) for t, sc in zip(s.pos[0][0, h], s.score[0][0, h],
                                                     strict=False)} for h in range(2)}
    q, k, v = _qkv(8, seed=99)
    q += 3 * e
    out = s.append(0, q, k, v)
    assert s.n[0] == 20 and s.free[0] is None and s.seen[0] == 44
    for h in range(2):
        grp = slice(2 * h, 2 * h + 2)
        keys = torch.cat([kall[:, h:h + 1, kept[h]], k[:, h:h + 1]], dim=2)
        vals = torch.cat([vall[:, h:h + 1, kept[h]], v[:, h:h + 1]], dim=2)
        ref, _ = dense_attention(q[:, grp], keys, vals)
        assert torch.allclose(out[:, grp], ref, atol=1e-5)
        # expected scores: kept scores + column sums of the new queries' causal softmax
        logits = q[0, grp] @ keys[0, 0].T / SPEC.head_dim ** 0.5  # [2, 8, 20 + 8]
        nk = len(kept[h])
        hidden = torch.arange(nk + 8)[None, :] > nk + torch.arange(8)[:, None]
        mass = logits.masked_fill(hidden, float("-inf")).softmax(-1).sum(dim=(0, 1))
        positions = kept[h] + list(range(36, 44))
        score = {t: before[h].get(t, 0.0) + float(m)
                 for t, m in zip(positions, mass, strict=True)}
        recent = set(range(34, 44))
        heavy = sorted(set(positions) - recent, key=score.__getitem__)[-10:]
        got = [int(t) for t in s.pos[0][0, h, :20]]
        assert set(got) == recent | set(heavy) and 5 in got and 15 not in got
        for j, t in enumerate(got):
            assert abs(float(s.score[0][0, h, j]) - score[t]) < 1e-4
    # the next decode step attends to the 20 kept tokens and itself
    qd, kd, vd = _qkv(1, seed=7)
    outd = s.decode(0, qd, kd, vd)
    kall, vall = torch.cat([kall, k, kd], dim=2), torch.cat([vall, v, vd], dim=2)
    for h in range(2):
        idx = [int(t) for t in s.pos[0][0, h, :21]]
        assert sorted(idx)[-1] == 44 and len(set(idx)) == 21
        ref, _ = dense_attention(qd[:, 2 * h:2 * h + 2], kall[:, h:h + 1, idx],
                                 vall[:, h:h + 1, idx], causal=False)
        assert torch.allclose(outd[:, 2 * h:2 * h + 2], ref, atol=1e-5)


def test_streaming_append_attends_cache_then_keeps_sinks_and_window() -> None:
    """An append attends to the sinks + window it found plus the new tokens (causal);
    afterwards decode steps see the first 4 and the latest 20 tokens."""
    s = STRATEGIES.get("streaming")(StreamingParams(gpu_share=0.3, sinks=4), context(80))
    assert (s.budget, s.ring) == (24, 20)
    steps = [_qkv(30, 2)] + [_qkv(1, 2, seed=i) for i in range(1, 6)] + [_qkv(8, 2, 6)] + [
        _qkv(1, 2, seed=i) for i in range(7, 11)]
    outs = []
    for q, k, v in steps:
        t = q.shape[2]
        fn = s.prefill if not outs else s.decode if t == 1 else s.append
        outs.append(fn(0, q, k, v))
    ks = torch.cat([st[1] for st in steps], dim=2)
    vs = torch.cat([st[2] for st in steps], dim=2)
    keep = list(range(4)) + list(range(15, 35))  # what the append found (35 tokens seen)
    keys = torch.cat([ks[:, :, keep], steps[6][1]], dim=2)
    vals = torch.cat([vs[:, :, keep], steps[6][2]], dim=2)
    ref, _ = dense_attention(steps[6][0], keys, vals)
    assert torch.allclose(outs[6], ref, atol=1e-5)
    for i in range(7, 11):
        t = 43 + i - 6  # tokens seen after this step
        keep = list(range(4)) + list(range(t - 20, t))
        ref, _ = dense_attention(steps[i][0], ks[:, :, keep], vs[:, :, keep], causal=False)
        assert torch.allclose(outs[i], ref, atol=1e-5)


def _records(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "run"]


def test_multiturn_cli_run_records(tmp_path: Path) -> None:
    """`--turns 3` end to end (warm-up, shadow in eval mode): append TTFT per later turn,
    decode steps numbered across turns, appends filed under the prefill phase, and the
    shadow's error ~0 for the exact offload strategy."""
    out = tmp_path / "r.jsonl"
    p, g = 16, 4
    with pytest.raises(SystemExit) as e:
        main(["run", "offload", "--model", "opt-125m", "--weights", "random", "--layers", "2",
              "--prompt-len", str(p), "--gen-len", str(g), "--batch", "2", "--mode", "eval",
              "--turns", "3", "--out", str(out)])
    assert e.value.code == 0
    recs = _records(out)
    by = {r["metric"]: r for r in recs if not r["metric"].startswith("trace.")}
    assert by["append_ttft"]["stats"]["n"] == 2 and by["append_ttft"]["unit"] == "s"
    assert by["tbt"]["stats"]["n"] == 3 * g and by["ttft"]["stats"]["n"] == 1
    assert all(r["params"]["turns"] == 3 for r in recs)
    n = p + g + 1
    tok = {r["params"]["phase"]: r["samples"] for r in recs if r["metric"] == "trace.tokens"
           and r["params"]["layer"] == 1 and r["params"]["where"] == "accel"}
    assert tok["prefill"] == [2.0 * (p + (n + p) + (2 * n + p))]
    assert tok["decode"] == [2.0 * (k * n + p + s) for k in range(3) for s in range(1, g + 1)]
    err = [max(r["samples"]) for r in recs if r["metric"] == "trace.rel_error"]
    assert len(err) == 4 and max(err) < 1e-5  # 2 layers x (prefill + appends, decode)


class Tiny(Strategy):
    """Test-only strategy without append."""

    name = "tiny"

    def prefill(self, layer, q, k, v):
        raise AssertionError("never reached")

    decode = prefill


def test_supports_append_and_refusal() -> None:
    assert not supports_append(Tiny)
    assert all(supports_append(STRATEGIES.get(n))
               for n in ("full", "offload", "h2o", "streaming"))
    from kvbench.runtime.command import execute

    with pytest.raises(KvbenchError, match="'tiny' has no append"):
        execute(Tiny, NoParams(), RunConfig(turns=2), None)
