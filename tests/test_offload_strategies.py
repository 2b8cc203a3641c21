"""Offload strategies I (issue 6): hgca, offload, h2o, streaming on synthetic q/k/v and
end to end on the bundled model; bad input through the CLI."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from conftest import assert_usage_error, cli, needs_bundled

from kvbench.cli import main
from kvbench.kernels.attention import dense_attention
from kvbench.models import get_spec
from kvbench.runtime.context import Counters, RunContext
from kvbench.strategies import STRATEGIES, NoParams
from kvbench.strategies.h2o import H2OParams
from kvbench.strategies.hgca import HgcaParams
from kvbench.strategies.streaming import StreamingParams

SPEC = get_spec("smollm2-135m")  # GQA: 9 query heads, 3 KV heads, head dim 64


def make(name: str, params, layers: int = 2, batch: int = 2, max_len: int = 80,
         device: torch.device = torch.device("cpu")):
    ctx = RunContext(SPEC, layers, batch, max_len, torch.float32, device, torch.device("cpu"),
                     Counters(SPEC.n_kv_heads, 4, cuda=device.type == "cuda"))
    return STRATEGIES.get(name)(params, ctx)


def inputs(p: int, g: int, batch: int = 2, seed: int = 0):
    """Prompt (q, k, v) then g single-token (q, k, v), [B, H, T, D] float32."""
    gen = torch.Generator().manual_seed(seed)

    def mk(t: int, h: int) -> torch.Tensor:
        return torch.randn(batch, h, t, SPEC.head_dim, generator=gen)

    steps = [(mk(p, SPEC.n_heads), mk(p, SPEC.n_kv_heads), mk(p, SPEC.n_kv_heads))]
    steps += [(mk(1, SPEC.n_heads), mk(1, SPEC.n_kv_heads), mk(1, SPEC.n_kv_heads))
              for _ in range(g)]
    return steps


def drive(s, steps) -> list[list[torch.Tensor]]:
    """Run prefill + decode over every layer; outputs[step][layer]."""
    outs = []
    for i, (q, k, v) in enumerate(steps):
        s.ctx.counters.step = i
        s.begin_step(i)
        row = []
        for layer in range(s.ctx.n_layers):
            s.ctx.counters.layer = layer
            row.append((s.prefill if i == 0 else s.decode)(layer, q, k, v))
        outs.append(row)
    return outs


def max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for ra, rb in zip(a, b, strict=True)
               for x, y in zip(ra, rb, strict=True))


@pytest.mark.parametrize("name, params, layers", [
    ("hgca", HgcaParams(gpu_tokens=16, block=8, beta=0.0), 2),
    ("offload", NoParams(), 3),  # odd layer count: the staging buffers alternate per call
    ("offload", NoParams(), 1),
    ("h2o", H2OParams(gpu_share=1.0), 2),
    ("streaming", StreamingParams(gpu_share=1.0), 2),
])
def test_exact_configurations_equal_full(name, params, layers) -> None:
    """hgca with beta 0 (ring wraps and evicts many times), offload, and h2o/streaming
    with the whole cache as budget reproduce full attention."""
    steps = inputs(40, 39)
    ref = drive(make("full", NoParams(), layers), steps)
    assert max_diff(drive(make(name, params, layers), steps), ref) < 2e-5


def test_hgca_ring_and_host_accounting() -> None:
    """GPU window never full between steps, every token on exactly one side, selection
    per row within the host cache, and the counters agree with the state."""
    s = make("hgca", HgcaParams(variant="union-ema", gpu_tokens=16, block=8, beta=1.0,
                                alpha=0.1), layers=1)
    steps = inputs(40, 39)
    drive(s, steps)
    s._join(s.layers[0])
    L = s.layers[0]
    # the prefill evicts 4 blocks (8 stay), then a block leaves whenever the ring fills:
    # 39 steps = 4 blocks + 7 tokens
    assert (L.n, L.n_host) == (15, 64)
    allk = torch.cat([k for _, k, _ in steps], dim=2)  # [B, Hkv, 79, D], token order
    assert torch.equal(L.hk[:, :, :64], allk[:, :, :64])  # KV_cpu: the oldest, in order
    assert torch.equal(torch.cat([p[0] for p in L.resident()], dim=2), allk[:, :, 64:])
    hv = L.hv[:, :, :64].reshape(-1, 64, 64)
    for r in range(L.lens.numel()):  # KV_ctx[r]: host entries of row r, in host order
        pos = _selected_positions(L, r)
        assert pos == sorted(set(pos)) and all(0 <= p < 64 for p in pos)
        assert torch.equal(L.cv.view(-1, L.cv.shape[2], 64)[r, :len(pos)], hv[r, pos])
    assert bool(((L.lens > 0) & (L.lens < 64)).any())  # beta 1: a partial selection
    c = s.ctx.counters
    b, hkv = 2, SPEC.n_kv_heads
    assert c.step_total("tokens", "host_resident", 39) == b * (L.n_host - 8 * (L.n == 8))
    # d2h at the prefill: ceil((40 - 16 + 1) / 8) = 4 blocks leave at once (Alg. 1 line 11)
    blocks = c.step_total("bytes_moved", "d2h", 0)
    assert blocks == 32 * b * (2 * hkv * 64 * 4 + SPEC.n_heads * 4)


def test_hgca_selection_rule_per_head() -> None:
    """Alg. 1 lines 23-25: KV_ctx[row] gets, in order, the evicted entries whose MAW exceeds
    beta / W for any query head of the KV head's group; KV_cpu gets all of them."""
    s = make("hgca", HgcaParams(variant="union-ema", gpu_tokens=16, block=8, beta=1.0),
             layers=1, batch=1)
    L = s.layers[0]
    k = torch.randn(1, 3, 8, 64)
    v = torch.randn(1, 3, 8, 64)
    maw = torch.full((1, 9, 8), 0.01)  # below 1 / 16
    maw[0, 0, 2] = 0.1  # KV head 0 (query heads 0-2): entry 2
    maw[0, 2, 5] = 0.07  # KV head 0: entry 5
    maw[0, 4, 7] = 1 / 16  # KV head 1: not strictly above the threshold
    maw[0, 8, [0, 1]] = 0.5  # KV head 2: entries 0 and 1
    s._select(L, k, v, maw, 16, None)
    assert L.n_host == 8 and torch.equal(L.hk[:, :, :8], k)
    assert L.lens.tolist() == [2, 0, 2]
    assert _selected_positions(L, 0) == [2, 5] and _selected_positions(L, 2) == [0, 1]
    assert torch.equal(L.ck[0, 0, :2], k[0, 0, [2, 5]])
    assert torch.equal(L.cv[0, 2, :2], v[0, 2, [0, 1]])
    s._select(L, k, v, maw, 16, None)  # a second block appends after the first
    assert L.lens.tolist() == [4, 0, 4] and _selected_positions(L, 0) == [2, 5, 10, 13]
    assert torch.equal(L.ck[0, 0, 2:4], k[0, 0, [2, 5]])


def test_hgca_prefill_weights_and_beta() -> None:
    """Prompt tokens evicted at prefill are selected from their prefill attention: a key
    every query attends to is kept at beta 1, and larger beta never selects more."""
    steps = inputs(40, 0, batch=1)
    q, k, v = steps[0]
    u = torch.randn(64)
    q[:] = u
    k[:, :, 3] = 8 * u / u.norm()  # token 3: the sink every query looks at
    lens = []
    for beta in (0.0, 0.5, 1.0, 4.0):
        s = make("hgca", HgcaParams(variant="union-ema", gpu_tokens=16, block=8, beta=beta,
                                    alpha=0.1), layers=1,
                 batch=1, max_len=41)
        s.prefill(0, q, k, v)
        s._join(s.layers[0])
        L = s.layers[0]
        assert L.n_host == 32 and L.n == 8
        lens.append(L.lens.clone())
        if beta == 1.0:
            assert all(3 in _selected_positions(L, r) for r in range(3))
    assert all(bool((a >= b).all()) for a, b in itertools.pairwise(lens))
    assert lens[0].tolist() == [32, 32, 32] and int(lens[-1].max()) < 32


def test_hgca_prefill_maw_of_uniform_attention() -> None:
    """The initial MAW puts prefill weights on the window's scale, where uniform attention
    is 1 / W: with every query attending uniformly (q = 0), key j of a T-token prompt
    keeps sum over its T - j queries of alpha (1 - alpha)^age / W, in closed form
    (1 - (1 - alpha)^(T - j)) / W, whatever the number of keys each query saw."""
    (q, k, v), = inputs(40, 0, batch=1)
    s = make("hgca", HgcaParams(variant="union-ema", gpu_tokens=16, block=8, beta=1.0,
                                alpha=0.1), layers=1, batch=1, max_len=41)
    s.prefill(0, torch.zeros_like(q), k, v)
    j = torch.arange(32, 40, dtype=torch.float64)  # the 8 tokens left resident
    want = (1 - 0.9 ** (40 - j)) / 16
    assert torch.allclose(s.layers[0].maw[0, :, :8].double(), want.expand(9, 8), atol=1e-7)


def test_hgca_decode_moving_average() -> None:
    """Alg. 1 line 8 at a decode step: resident entries' MAW <- (1 - alpha) MAW + alpha x
    the window softmax of the step's query (the new entry starting from 0)."""
    s = make("hgca", HgcaParams(variant="union-ema", gpu_tokens=16, block=8, beta=1.0,
                                alpha=0.3), layers=1, batch=1, max_len=40)
    (q0, k0, v0), (q, k, v) = inputs(8, 1, batch=1)
    s.prefill(0, q0, k0, v0)
    L = s.layers[0]
    before = L.maw[:, :, :8].clone()
    s.decode(0, q, k, v)
    s._join(L)
    keys = torch.cat([k0, k], dim=2).repeat_interleave(3, dim=1)  # [1, 9, 9, 64]
    soft = ((q @ keys.transpose(-1, -2)) / 8).softmax(dim=-1)[:, :, 0]  # [1, 9, 9]
    prev = torch.cat([before, torch.zeros(1, 9, 1)], dim=2)
    assert torch.allclose(L.maw[:, :, :9], 0.7 * prev + 0.3 * soft, atol=1e-6)


def _selected_positions(L, row: int) -> list[int]:
    """KV_cpu positions of the entries in KV_ctx[row] (the oldest tokens first: the prompt
    positions of a prefill's evictions)."""
    return L.cpos[row, :int(L.lens[row])].tolist()


def test_streaming_attends_sinks_and_recent_window(device: torch.device) -> None:
    """Each decode output equals dense attention over the first 4 and the last 20 tokens."""
    steps = inputs(30, 12)
    s = make("streaming", StreamingParams(gpu_share=0.3, sinks=4), layers=1, max_len=80,
             device=device)
    outs = [[o.cpu() for o in row]
            for row in drive(s, [tuple(x.to(device) for x in st) for st in steps])]
    ks = torch.cat([st[1] for st in steps], dim=2)
    vs = torch.cat([st[2] for st in steps], dim=2)
    for i in range(1, 13):
        t = 30 + i  # tokens seen
        keep = list(range(4)) + list(range(t - 20, t))
        ref, _ = dense_attention(steps[i][0], ks[:, :, keep], vs[:, :, keep], causal=False)
        assert torch.allclose(outs[i][0], ref, atol=1e-5)


def test_streaming_next_turn_keeps_sinks_and_ring_across_the_chunk() -> None:
    """Budget 8 (2 sinks, a ring of 6), prompt 12, 3 decode steps, a second turn's 7-token
    chunk appended (more than the ring: its first token falls out), then a 3-token chunk
    that attends what the first left in the ring, 3 more decode steps. At
    every step each query attends, in float64 done here, the positions held before it (the
    sinks and the ring's latest; a decode step's own token already in the ring) plus the new
    tokens up to itself, and the step files those tokens as attended on the accelerator."""
    sinks, ring = 2, 6
    steps = inputs(12, 6, seed=3)
    gen = torch.Generator().manual_seed(4)
    chunks = [tuple(torch.randn(2, h, t, SPEC.head_dim, generator=gen)
                    for h in (SPEC.n_heads, SPEC.n_kv_heads, SPEC.n_kv_heads)) for t in (7, 3)]
    steps = [*steps[:4], *chunks, *steps[4:]]
    s = make("streaming", StreamingParams(gpu_tokens=sinks + ring, sinks=sinks), layers=1,
             max_len=40)
    ks = torch.cat([st[1] for st in steps], dim=2).double()
    vs = torch.cat([st[2] for st in steps], dim=2).double()
    g, t0 = SPEC.n_heads // SPEC.n_kv_heads, 0
    for i, (q, k, v) in enumerate(steps):
        s.ctx.counters.step = i
        out = (s.prefill if i == 0 else s.decode if q.shape[2] == 1 else s.append)(0, q, k, v)
        n_new = q.shape[2]
        # a decode step's token takes its ring slot first (the budget counts it); a chunk
        # is attended beside the whole cache and trimmed after
        last = t0 + 1 - ring if i and n_new == 1 else t0 - ring
        held = [j for j in range(t0) if j < sinks or j >= last]
        for qi in range(n_new):
            pos = held + list(range(t0, t0 + qi + 1))
            for h in range(SPEC.n_heads):
                kk, vv = ks[:, h // g, pos], vs[:, h // g, pos]  # [B, m, D]
                w = torch.softmax(kk @ q[:, h, qi, :, None].double() / SPEC.head_dim ** 0.5,
                                  dim=1)
                want = (w * vv).sum(dim=1)
                assert (out[:, h, qi].double() - want).abs().max() < 1e-5, (i, qi, h)
        assert s.ctx.counters.step_total("tokens", "accel", i) == 2 * (len(held) + n_new), i
        t0 += n_new


def test_h2o_keeps_budget_recent_and_heavy_hitters() -> None:
    """Each row holds budget tokens: the recent window plus the top accumulated scores;
    outputs equal dense attention over exactly the kept tokens (per head)."""
    steps = inputs(30, 10, batch=1)
    e = torch.zeros(64)
    e[0] = 1.0
    for st in steps:
        st[0][:] += 3 * e  # queries share a direction
    steps[0][1][:, :, 5] = 20 * e  # token 5: a heavy hitter for every query
    steps[0][1][:, :, 15] = -20 * e  # token 15: ignored by every query
    s = make("h2o", H2OParams(gpu_share=0.25, recent=0.5), layers=1, batch=1, max_len=80)
    outs = drive(s, steps)
    ks = torch.cat([st[1] for st in steps], dim=2)
    vs = torch.cat([st[2] for st in steps], dim=2)
    pos = s.pos[0][:, :, :s.budget + 1]
    last = 40  # tokens seen
    for h in range(3):
        kept = set(pos[0, h].tolist()) - {int(pos[0, h, s.free[0][0, h]])}
        assert len(kept) == 20 and set(range(last - 10, last)) <= kept
        assert 5 in kept and 15 not in kept
    q = steps[-1][0]
    for h in range(3):  # the last step attended to all 21 slots
        idx = pos[0, h].tolist()
        g = slice(3 * h, 3 * h + 3)
        ref, _ = dense_attention(q[:, g], ks[:, h:h + 1, idx], vs[:, h:h + 1, idx], causal=False)
        assert torch.allclose(outs[-1][0][:, g], ref, atol=1e-5)


def _records(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "run"]


@needs_bundled
def test_hgca_beta0_perplexity_equals_full_on_bundled_model(tmp_path: Path) -> None:
    """Issue bar: the hybrid path is exact end to end (perplexity within 1e-4 relative),
    and the shadow reports ~0 per-layer attention error."""
    ppl, err = {}, {}
    common = ["--mode", "eval", "--prompt-len", "48", "--gen-len", "40"]
    for name, extra in (("full", []), ("hgca", ["--beta", "0", "--gpu-tokens", "32",
                                                "--block", "16"])):
        out = tmp_path / f"{name}.jsonl"
        with pytest.raises(SystemExit) as e:
            main(["run", name, *common, *extra, "--out", str(out)])
        assert e.value.code == 0
        recs = _records(out)
        ppl[name] = next(r["value"] for r in recs if r["metric"] == "perplexity")
        err[name] = [max(r["samples"]) for r in recs if r["metric"] == "trace.rel_error"
                     and r["params"]["phase"] == "decode"]
    assert 1.5 < ppl["full"] < 100
    assert abs(ppl["hgca"] / ppl["full"] - 1) < 1e-4
    assert len(err["hgca"]) == 30 and max(err["hgca"]) < 1e-5


@pytest.mark.parametrize("args, message", [
    (["hgca", "--beta", "-0.5"], "--beta -0.5: must be >= 0"),
    (["hgca", "--gpu-share", "0"], "--gpu-share 0.0: must be in (0, 1]"),
    (["hgca", "--gpu-share", "1.5"], "--gpu-share 1.5: must be in (0, 1]"),
    (["hgca", "--cpu-threads", "-1"], "--cpu-threads -1: must be >= 0 (0: automatic)"),
    (["hgca", "--gpu-tokens", "100", "--block", "64"], "does not divide the GPU window"),
    (["hgca", "--gpu-share", "0.01"], "leaves no room for the prompt"),
    (["h2o", "--gpu-share", "0"], "--gpu-share 0.0: must be in (0, 1]"),
    (["streaming", "--gpu-share", "0.01"], "leaves no recent window"),
    (["nosuch"], "nosuch"),
])
def test_bad_input_exits_2(args: list[str], message: str, capsys, tmp_path: Path) -> None:
    assert_usage_error(cli(["run", *args, "--model", "opt-125m", "--weights", "random",
                            "--layers", "1", "--prompt-len", "200", "--gen-len", "8", "--out",
                            str(tmp_path / "x.jsonl")], capsys), message)


def test_machine_defaults_without_gpu() -> None:
    """`kvbench run hgca --model opt-6.7b` on a CPU machine: fewer layers, said so; an
    explicit --layers and a GPU run are left alone."""
    from kvbench.runtime.machine import CPU_WEIGHT_BUDGET, machine_defaults

    spec = get_spec("opt-6.7b")
    cpu = torch.device("cpu")
    layers, notes = machine_defaults(spec, 0, 32, cpu, "random", 4, 256, 32)
    assert 1 <= layers < 32 and spec.params(layers) * 4 <= CPU_WEIGHT_BUDGET
    text = " ".join(notes)
    assert "CPU timings" in text and "random weights" in text and f"{layers} of 32" in text
    assert machine_defaults(spec, 32, 32, cpu, "random", 4, 256, 32)[0] == 32
    assert machine_defaults(spec, 0, 32, torch.device("cuda"), "random", 4, 256, 32) == (32, [])


@pytest.mark.gpu
@pytest.mark.parametrize("name, params", [
    ("hgca", HgcaParams(gpu_tokens=16, block=8, beta=0.0)),
    ("offload", NoParams()),
])
def test_cuda_paths_equal_full(name, params) -> None:
    """On a GPU: side-stream evictions/prefetches, pinned buffers and the host part merged
    into the GPU output reproduce full attention (float32)."""
    cuda = torch.device("cuda")
    steps = [tuple(t.to(cuda) for t in st) for st in inputs(40, 39)]

    def on_gpu(n: str, p):
        ctx = RunContext(SPEC, 3, 2, 80, torch.float32, cuda, torch.device("cpu"),
                         Counters(SPEC.n_kv_heads, 4, cuda=True))
        return STRATEGIES.get(n)(p, ctx)

    ref = drive(on_gpu("full", NoParams()), steps)
    got = drive(on_gpu(name, params), steps)
    torch.cuda.synchronize()
    assert max_diff(got, ref) < 2e-5


def test_hgca_maw_handed_to_selection_after_the_ring_wraps(monkeypatch) -> None:
    """Alg. 1 lines 8-13 across a wrapped ring: the MAW of each evicted block, as the
    selection receives it, equals the moving average of the plain window softmax of
    every decode query that saw the entry (from 0 at its insertion), computed directly
    over the tokens resident at each step; KV_ctx gets the entries above beta / W."""
    alpha, w = 0.2, 16
    s = make("hgca", HgcaParams(variant="union-ema", gpu_tokens=w, block=8, beta=1.0,
                                alpha=alpha), layers=1, batch=1, max_len=40)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (k, maw) of each eviction
    select = s._select

    def spy(L, k, v, maw, size, copied):
        seen.append((k.clone(), maw.clone()))
        return select(L, k, v, maw, size, copied)

    monkeypatch.setattr(s, "_select", spy)
    steps = inputs(4, 28, batch=1)  # 4 prompt tokens (no prefill eviction), 28 decode steps
    resident = list(range(4))  # token ids on the accelerator, oldest first
    keys = [steps[0][1][0, :, i] for i in range(4)]  # [Hkv, D] per token
    maw: dict[int, torch.Tensor] = {}  # token id -> [Hq] moving average (decoded tokens)
    evicted: list[list[int]] = []
    s.prefill(0, *steps[0])
    for t, (q, k, v) in enumerate(steps[1:], start=4):
        s.begin_step(t - 3)
        s.decode(0, q, k, v)
        keys.append(k[0, :, 0])
        resident.append(t)
        maw[t] = torch.zeros(9)
        kk = torch.stack([keys[i] for i in resident], dim=1).repeat_interleave(3, dim=0)
        soft = (torch.einsum("hd,hnd->hn", q[0, :, 0], kk) / 8).softmax(dim=-1)  # [Hq, n]
        for col, i in enumerate(resident):
            if i in maw:
                maw[i] = (1 - alpha) * maw[i] + alpha * soft[:, col]
        if len(resident) == w:  # full: the oldest block leaves
            evicted.append(resident[:8])
            resident = resident[8:]
    s._join(s.layers[0])
    assert [b[0] for b in evicted] == [0, 8, 16] and len(seen) == 3
    # block 0 holds prompt tokens (initial MAW from the prefill); blocks 1 and 2 are all
    # decoded tokens, block 2 inserted into slots 0-7 after the ring wrapped
    for (k_sel, maw_sel), block in zip(seen[1:], evicted[1:], strict=True):
        assert torch.equal(k_sel[0], torch.stack([keys[i] for i in block], dim=1))
        want = torch.stack([maw[i] for i in block], dim=1)  # [Hq, 8]
        assert torch.allclose(maw_sel[0], want, atol=1e-6)
    L = s.layers[0]
    ref = torch.stack([maw[i] for b in evicted[1:] for i in b], dim=1)  # [Hq, 16]
    keep = ref.view(3, 3, 16).amax(dim=1) > 1.0 / w  # [Hkv, 16]
    margin = (ref.view(3, 3, 16).amax(dim=1) - 1.0 / w).abs().min()
    assert margin > 1e-5 and keep.any() and not keep.all()
    for r in range(3):  # KV_ctx[r] after block 0: the entries of blocks 1-2 above beta / W
        got = [p - 8 for p in _selected_positions(L, r) if p >= 8]
        assert got == keep[r].nonzero().flatten().tolist()


def _h2o_reference(steps, budget: int, n_recent: int, hq: int, hkv: int):
    """H2O by plain loops in float64, per (batch, KV head) row: a dict position -> score.
    Prefill: causal attention over the prompt, scores the column sums over the group's query
    heads, then the latest n_recent positions plus the highest-scoring others, budget in
    all. Each decode step: the new token joins (score 0), every query head of the group
    attends all kept tokens, their weights are added, and when budget + 1 are kept the
    lowest-scoring token older than the latest n_recent is dropped. A later step of T > 1
    tokens (a next turn's chunk) appends them after the kept tokens: each new query attends
    the kept tokens and the new ones up to itself, all weights are added, and over budget the
    latest n_recent plus the highest-scoring others are kept. Returns the outputs
    [step] -> [B, Hq, T, D], the kept positions [step][b][h] after each step and their
    scores [step][b][h] -> {position: score}."""
    q0, k0, v0 = (t.double() for t in steps[0])
    b, _, p, d = q0.shape
    g = hq // hkv
    kept = [[{} for _ in range(hkv)] for _ in range(b)]
    keys = [[{} for _ in range(hkv)] for _ in range(b)]  # position -> (k, v)
    outs, sets, scores = [], [], []
    out = torch.zeros(b, hq, p, d, dtype=torch.float64)
    for bi in range(b):
        for h in range(hkv):
            col = torch.zeros(p, dtype=torch.float64)
            for qh in range(g * h, g * h + g):
                for i in range(p):
                    w = torch.softmax(k0[bi, h, :i + 1] @ q0[bi, qh, i] / d ** 0.5, dim=0)
                    out[bi, qh, i] = w @ v0[bi, h, :i + 1]
                    col[:i + 1] += w
            recent = set(range(p - n_recent, p))
            others = sorted((j for j in range(p) if j not in recent), key=lambda j: -col[j])
            chosen = recent | set(others[:max(0, budget - len(recent))])
            kept[bi][h] = {j: float(col[j]) for j in chosen}
            keys[bi][h] = {j: (k0[bi, h, j], v0[bi, h, j]) for j in range(p)}
    outs.append(out)
    sets.append([[set(kept[bi][h]) for h in range(hkv)] for bi in range(b)])
    scores.append([[dict(kept[bi][h]) for h in range(hkv)] for bi in range(b)])
    t = p
    for q, k, v in steps[1:]:
        q, k, v = q.double(), k.double(), v.double()
        n_new = q.shape[2]
        out = torch.zeros(b, hq, n_new, d, dtype=torch.float64)
        for bi in range(b):
            for h in range(hkv):
                row = kept[bi][h]
                for i in range(n_new):
                    row[t + i] = 0.0
                    keys[bi][h][t + i] = (k[bi, h, i], v[bi, h, i])
                pos = sorted(row)
                kk = torch.stack([keys[bi][h][j][0] for j in pos])
                vv = torch.stack([keys[bi][h][j][1] for j in pos])
                for qh in range(g * h, g * h + g):
                    for i in range(n_new):  # the kept tokens, then the new ones up to i
                        upto = len(pos) - n_new + i + 1
                        w = torch.softmax(kk[:upto] @ q[bi, qh, i] / d ** 0.5, dim=0)
                        out[bi, qh, i] = w @ vv[:upto]
                        for j, wj in zip(pos[:upto], w.tolist(), strict=True):
                            row[j] += wj
                if n_new == 1 and len(row) == budget + 1:
                    old = [j for j in row if j < t + 1 - n_recent]
                    del row[min(old, key=lambda j: row[j])]
                elif n_new > 1 and len(row) > budget:
                    recent = {j for j in row if j >= t + n_new - n_recent}
                    others = sorted((j for j in row if j not in recent), key=lambda j: -row[j])
                    keep = recent | set(others[:budget - len(recent)])
                    kept[bi][h] = {j: row[j] for j in sorted(keep)}
        t += n_new
        outs.append(out)
        sets.append([[set(kept[bi][h]) for h in range(hkv)] for bi in range(b)])
        scores.append([[dict(kept[bi][h]) for h in range(hkv)] for bi in range(b)])
    return outs, sets, scores


def _h2o_rows(s, batch: int) -> list[list[set[int]]]:
    """The positions layer 0 of an H2O strategy keeps, per (sequence, KV head)."""
    n, pos, free = s.n[0], s.pos[0], s.free[0]
    rows = []
    for bi in range(batch):
        row = []
        for h in range(SPEC.n_kv_heads):
            held = pos[bi, h, :n].tolist()
            if free is not None:  # the slot freed this step no longer counts
                del held[int(free[bi, h])]
            row.append(set(held))
        rows.append(row)
    return rows


@pytest.mark.parametrize("home", ["accel", "host"])
def test_h2o_next_turn_after_evictions_matches_the_reference(home: str) -> None:
    """A second turn's 5-token chunk appended after decode steps that evicted (the cache
    holds a freed slot, compacted before the append), then more decode steps: outputs and
    kept positions equal the float64 reference's at every step, the kept tokens' keys are
    those of their positions (compaction moved whole rows), and each step files the tokens
    it attended and its scores' upkeep."""
    steps = inputs(16, 9, batch=2, seed=7)
    gen = torch.Generator().manual_seed(8)
    chunk = tuple(torch.randn(2, h, 5, SPEC.head_dim, generator=gen)
                  for h in (SPEC.n_heads, SPEC.n_kv_heads, SPEC.n_kv_heads))
    steps = [*steps[:5], chunk, *steps[5:]]
    s = make("h2o", H2OParams(gpu_tokens=10, recent=0.4, kv_home=home), layers=1, batch=2,
             max_len=48)
    ref_outs, ref_sets, ref_scores = _h2o_reference(steps, 10, 4, SPEC.n_heads,
                                                    SPEC.n_kv_heads)
    keys = torch.cat([k for _, k, _ in steps], dim=2)  # [B, Hkv, 30, D] by position
    for i, (q, k, v) in enumerate(steps):
        s.ctx.counters.step = i
        fn = s.prefill if i == 0 else s.decode if q.shape[2] == 1 else s.append
        if i and q.shape[2] > 1:
            assert s.free[0] is not None  # a freed slot to compact
        out = fn(0, q, k, v)
        assert (out.double() - ref_outs[i]).abs().max() < 1e-5, i
        assert _h2o_rows(s, 2) == ref_sets[i], i
        free = s.free[0]
        for bi in range(2):  # every kept token's accumulated score, the chunk's included
            for h in range(SPEC.n_kv_heads):
                got = {int(p): float(x) for j, (p, x) in enumerate(zip(
                    s.pos[0][bi, h, :s.n[0]], s.score[0][bi, h, :s.n[0]], strict=True))
                    if free is None or j != int(free[bi, h])}
                want = ref_scores[i][bi][h]
                assert got.keys() == want.keys(), (i, bi, h)
                assert all(abs(got[k] - want[k]) < 1e-4 for k in want), (i, bi, h)
        # its work: the kept tokens and the new ones attended, the scores' upkeep timed
        attended = (len(ref_sets[i - 1][0][0]) if i else 0) + q.shape[2]
        assert s.ctx.counters.step_total("tokens", "accel", i) == 2 * attended, i
        assert s.ctx.counters.step_total("time", "bookkeeping.scores", i) > 0, i
        n = s.n[0]
        held = s.pos[0][:, :, :n]
        want = keys.gather(2, held[..., None].expand(-1, -1, -1, SPEC.head_dim))
        assert torch.equal(s.k[0][:, :, :n], want), i


def test_h2o_says_its_selection_runs_in_torch_ops() -> None:
    """Issue 26: a strategy without a fused path says so: H2O's prompt cut and its decode
    step's eviction scores are noted as torch-select, in their phases."""
    from kvbench.kernels.attention import backend_use

    steps = inputs(16, 2, batch=2, seed=9)
    s = make("h2o", H2OParams(gpu_tokens=10, recent=0.4), layers=1)
    backend_use(reset=True)
    s.prefill(0, *steps[0])
    assert "torch-select" in backend_use(reset=True)["prefill/append"].split("+")
    s.decode(0, *steps[1])
    assert "torch-select" in backend_use(reset=True)["decode"].split("+")


def test_h2o_with_its_kv_on_the_host_loads_it_each_step_and_writes_back_one_token() -> None:
    """--kv-home host (HGCA Fig. 12's H2O, FlexGen with InfiniGen's set-up): the same outputs
    and kept sets as the KV on the accelerator, the host copy holding exactly the kept k/v
    after every step; each decode step loads a layer's kept k/v whole (h2d: budget + 1 slots
    a row) and writes back the new token (d2h: one a row), a prompt its kept set whole;
    placement puts the k/v on the host and one layer's staging on the accelerator."""
    per_layer = (inputs(16, 12, batch=2, seed=3), inputs(16, 12, batch=2, seed=4))
    on = {h: make("h2o", H2OParams(gpu_tokens=10, recent=0.4, kv_home=h), layers=2,
                  max_len=40) for h in ("accel", "host")}
    buf = 2 * 2 * SPEC.n_kv_heads * 11 * SPEC.head_dim * 4  # a layer's k and v, 11 slots
    row = 2 * 2 * SPEC.n_kv_heads * SPEC.head_dim * 4  # one token's k and v, 2 sequences
    for i in range(len(per_layer[0])):  # the layers' inputs differ: one staging for both
        outs = {}
        for h, s in on.items():
            s.ctx.counters.step = i
            outs[h] = [(s.prefill if i == 0 else s.decode)(layer, *per_layer[layer][i])
                       for layer in range(2)]
        assert all(torch.equal(a, b) for a, b in zip(*outs.values(), strict=True)), i
        acc, host = on["accel"], on["host"]
        assert _h2o_rows(acc, 2) == _h2o_rows(host, 2), i
        n = host.n[0]
        assert torch.equal(acc.k[1][:, :, :n], host.k[1][:, :, :n]), i
        assert torch.equal(acc.v[0][:, :, :n], host.v[0][:, :, :n]), i
        moved = {link: host.ctx.counters.step_total("bytes_moved", link, i)
                 for link in ("h2d", "d2h")}
        assert moved == ({"h2d": 0, "d2h": 2 * buf} if i == 0 else
                         {"h2d": 2 * buf, "d2h": 2 * row}), i
        assert acc.ctx.counters.step_total("bytes_moved", "h2d", i) == 0
    meta = 2 * 2 * SPEC.n_kv_heads * (11 * (4 + 8) + 8)  # scores, positions, freed slots
    assert type(acc).placement(acc.p, acc.ctx) == {"accel": 2 * buf + meta, "host": 0}
    assert type(host).placement(host.p, host.ctx) == {"accel": buf + meta, "host": 2 * buf,
                                                      "pinned": 0}


@pytest.mark.parametrize("home", ["accel", "host"])
@pytest.mark.parametrize("prompt, gen, budget, recent", [(16, 12, 10, 4), (4, 24, 8, 2)])
def test_h2o_decode_eviction_matches_a_float64_reference(device: torch.device, prompt: int,
                                                         gen: int, budget: int, recent: int,
                                                         home: str) -> None:
    """Issue 30: H2O over `prompt` tokens and `gen` decode steps, batch 2: every step's
    output equals the float64 reference's (which keeps its own scores and evicts by them,
    independent of the strategy's kept set), and the strategy keeps exactly the reference's
    positions per row after every step. Rows come to differ (eviction is per head). With a
    4-token prompt under a budget of 8, the decode steps' own weights decide every eviction."""
    steps = inputs(prompt, gen, batch=2, seed=5)
    s = make("h2o", H2OParams(gpu_tokens=budget, recent=recent / budget, kv_home=home),
             layers=1, batch=2, max_len=prompt + gen + 4, device=device)
    assert (s.budget, s.n_recent) == (budget, recent)
    ref_outs, ref_sets, _ = _h2o_reference(steps, budget, recent, SPEC.n_heads,
                                           SPEC.n_kv_heads)
    got_sets = []
    for i, (q, k, v) in enumerate(steps):
        s.ctx.counters.step = i
        out = (s.prefill if i == 0 else s.decode)(0, q.to(device), k.to(device), v.to(device))
        assert (out.cpu().double() - ref_outs[i]).abs().max() < 1e-5, i
        rows = _h2o_rows(s, 2)
        assert rows == ref_sets[i], i
        got_sets.append(rows)
    assert all(len(x) == budget for r in ref_sets[-gen // 2:] for row in r for x in row)
    last = got_sets[-1]
    assert len({frozenset(x) for row in last for x in row}) > 1  # per-head eviction
