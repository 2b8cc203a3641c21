"""ScoutAttention (kvbench.strategies.scout) against an independent reference (loops over
blocks, float64 softmax and log-sum-exp merge), on the bundled model (exact settings, the
predicted query's error), the recall-interval file, and its bad input."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import ancestors, assert_usage_error, cli

from kvbench.cli import main
from kvbench.errors import KvbenchError
from kvbench.models import ModelSpec
from kvbench.runtime.context import Counters, RunContext
from kvbench.runtime.run import decode_run, read_text, token_rows
from kvbench.strategies import _scout_recall
from kvbench.strategies.scout import Scout, ScoutParams

SPEC = ModelSpec("tiny-gqa", "llama", 3, 6, 2, 48, 96, 100, 512, head_dim=8)
CPU = torch.device("cpu")


class _Model:
    """Stands in for the decoder: `query` returns the predicted query set by the test."""

    q: torch.Tensor

    def query(self, layer: int, x: torch.Tensor, start: int) -> torch.Tensor:
        return self.q


def _ctx(max_len: int, device: torch.device = CPU) -> RunContext:
    return RunContext(SPEC, 2, 2, max_len, torch.float32, device, CPU,
                      Counters(2, 4, cuda=device.type == "cuda"), _Model())


def _bound(q: torch.Tensor, keys: torch.Tensor) -> float:
    """Quest's upper bound of q [D] over a block's keys [n, D]."""
    return float(torch.maximum(q * keys.amax(0), q * keys.amin(0)).sum())


def _top(scores: list[float], k: int) -> set[int]:
    return set(sorted(range(len(scores)), key=lambda p: -scores[p])[:k])


def _part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Attention of q [D] over k/v [n, D] in float64 and its log-sum-exp."""
    logits = (k.double() @ q.double()) * q.shape[0] ** -0.5
    w = torch.softmax(logits, 0)
    return (w[:, None] * v.double()).sum(0), float(torch.logsumexp(logits, 0))


@pytest.mark.parametrize("per", ["kv", "query"])
def test_decode_matches_algorithm_1(per: str, device: torch.device) -> None:
    """Layer 1 of a 2-layer run (layer 0 dense): resident = top C blocks by the prompt's last
    query; the predicted query picks the blocks (window + top); the accelerator attends the
    resident ones with the real query, the host the others with the predicted one; merged
    by lse. A recall (R = 1) then makes the real query's top C resident. --pred-error: the
    error against the real query's own selection attended whole, and the blocks it shares."""
    g = torch.Generator().manual_seed(0)
    s_, n0, c_res = 4, 22, 2  # blocks of 4; 5 full blocks + 2 tokens in the window block
    s = Scout(ScoutParams(budget_tokens=16, page_size=s_, resident_blocks=c_res,
                          dense_layers=1, recall_interval=1, topk_per=per,
                          pred_error=True), _ctx(40, device))
    k = torch.randn(2, 2, n0, 8, generator=g)
    v = torch.randn(2, 2, n0, 8, generator=g)
    qp = torch.randn(2, 6, n0, 8, generator=g)
    s.prefill(1, qp.to(device), k.to(device), v.to(device))
    pred = torch.randn(2, 6, 1, 8, generator=g)
    s.ctx.model.q = pred.to(device)
    s.begin_step(1)
    s.ctx.counters.step = 1
    s.layer_input(0, torch.zeros(2, 1, 48, device=device))
    assert s.pending[1][2] is not None  # the host part was started a layer ahead
    q = pred + 0.5 * torch.randn(2, 6, 1, 8, generator=g)
    kn, vn = torch.randn(2, 2, 1, 8, generator=g), torch.randn(2, 2, 1, 8, generator=g)
    s.ctx.counters.layer = 1
    out = s.decode(1, q.to(device), kn.to(device), vn.to(device)).cpu()
    k, v = torch.cat([k, kn], 2), torch.cat([v, vn], 2)
    recalled, err2, ref2, shared = 0, 0.0, 0.0, []
    for b in range(2):
        for kh in range(2):
            blocks = [k[b, kh, p * s_:(p + 1) * s_] for p in range(5)]
            group = range(3 * kh, 3 * kh + 3)
            resident = _top([sum(_bound(qp[b, h, -1], x) for h in group) for x in blocks],
                            c_res)
            for h in group:
                heads = [h] if per == "query" else group  # whose bounds are summed
                chosen = _top([sum(_bound(pred[b, x, 0], blk) for x in heads)
                               for blk in blocks], 3)
                on = [t for p in sorted(chosen & resident) for t in range(p * s_, p * s_ + s_)]
                on += list(range(20, 23))  # the window block, the new token included
                off = [t for p in sorted(chosen - resident) for t in range(p * s_,
                                                                            p * s_ + s_)]
                oa, la = _part(q[b, h, 0], k[b, kh, on], v[b, kh, on])
                if off:
                    oh, lh = _part(pred[b, h, 0], k[b, kh, off], v[b, kh, off])
                    w = 1 / (1 + math.exp(lh - la))
                    oa = w * oa + (1 - w) * oh
                assert torch.allclose(out[b, h, 0].double(), oa, atol=1e-5)
                real = _top([sum(_bound(q[b, x, 0], blk) for x in heads) for blk in blocks], 3)
                every = [t for p in sorted(real) for t in range(p * s_, p * s_ + s_)]
                every += [20, 21, 22]  # the window block
                ref = _part(q[b, h, 0], k[b, kh, every], v[b, kh, every])[0]
                err2 += float(((out[b, h, 0].double() - ref) ** 2).sum())
                ref2 += float((ref ** 2).sum())
                shared.append((len(real & chosen) + 1) / 4)  # the window block is in both
            want = _top([sum(_bound(q[b, h, 0], x) for h in group) for x in blocks], c_res)
            got = set(s.res[1][b, kh, :5].nonzero().flatten().tolist())
            assert got == want  # after the recall
            recalled += len(want - resident)
    c = s.ctx.counters
    ratio = c.step_total("cpu_ratio", "host", 1)
    assert 0 < ratio < 1  # host tokens / the 16-token budget
    assert recalled > 0
    assert c.step_total("pages", "recalled", 1) == recalled
    assert c.step_total("bytes_moved", "h2d.recall", 1) == recalled * 2 * s_ * 8 * 4
    cos = torch.nn.functional.cosine_similarity(pred, q, dim=-1).mean()
    assert abs(c.step_total("q_cosine", "predicted", 1) - float(cos)) < 1e-6
    assert err2 > 0
    assert abs(c.step_total("pred_error", "predicted", 1) / math.sqrt(err2 / ref2) - 1) < 1e-4
    assert abs(c.step_total("pred_overlap", "predicted", 1) - sum(shared) / len(shared)) < 1e-6


def _prefilled(params: ScoutParams, n: int, seed: int
               ) -> tuple[Scout, torch.Tensor, torch.Generator]:
    """Scout on a 40-token cache with an n-token random prompt in layer 1: (strategy, the
    prompt's keys [2, 2, n, 8], the generator for what follows)."""
    g = torch.Generator().manual_seed(seed)
    s = Scout(params, _ctx(40))
    k = torch.randn(2, 2, n, 8, generator=g)
    s.prefill(1, torch.randn(2, 6, n, 8, generator=g), k,
              torch.randn(2, 2, n, 8, generator=g))
    return s, k, g


@pytest.mark.parametrize("rule", ["score", "lru"])
def test_recall_evicts_by_rule(rule: str) -> None:
    """A recall makes the real query's top C blocks resident and evicts, of the resident
    blocks outside them, the lowest-scoring ("score") or least recently selected ("lru")."""
    s, k, g = _prefilled(ScoutParams(budget_tokens=16, page_size=4, resident_blocks=3,
                                     dense_layers=1, recall_evict=rule), 26, seed=5)
    s.res[1][:, :, :6] = torch.tensor([True, True, True, False, False, False])
    s.used[1][:, :, :6] = torch.tensor([3.0, 1.0, 2.0, 0.0, 0.0, 0.0])
    q = torch.randn(2, 6, 1, 8, generator=g)
    s._recall(1, q)
    for b in range(2):
        for kh in range(2):
            blocks = [k[b, kh, p * 4:(p + 1) * 4] for p in range(6)]
            scores = [sum(_bound(q[b, h, 0], x) for h in range(3 * kh, 3 * kh + 3))
                      for x in blocks]
            target = _top(scores, 3)
            cand = sorted({0, 1, 2} - target,
                          key=lambda p: scores[p] if rule == "score" else [3, 1, 2][p])
            evicted = set(cand[:len(target - {0, 1, 2})])
            want = ({0, 1, 2} - evicted) | target
            assert set(s.res[1][b, kh, :6].nonzero().flatten().tolist()) == want
            for p in evicted:  # the accelerator's copy is gone
                assert s.acc_k[1][b, kh, p * 4:(p + 1) * 4].isnan().all()
    assert s.ctx.counters.step_total("pages", "evicted", 0) > 0


def test_window_blocks_stay_resident_while_there_is_room() -> None:
    """A block leaving the window stays on the accelerator while fewer than C are resident,
    else it is host-only (its accelerator copy is cleared to NaN)."""
    g = torch.Generator().manual_seed(1)
    s = Scout(ScoutParams(budget_tokens=16, page_size=4, resident_blocks=2, dense_layers=1,
                          recall=False), _ctx(40))
    s.prefill(1, torch.randn(2, 6, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g),
              torch.randn(2, 2, 5, 8, generator=g))
    assert s.res[1][:, :, 0].all()  # block 0 below the window, room for it
    for _ in range(8):  # blocks 1 and 2 leave the window; only block 1 finds room
        q = torch.randn(2, 6, 1, 8, generator=g)
        s.decode(1, q, torch.randn(2, 2, 1, 8, generator=g),
                 torch.randn(2, 2, 1, 8, generator=g))
    assert s.res[1][:, :, :3].tolist() == [[[True, True, False]] * 2] * 2
    assert s.acc_k[1][:, :, 8:12].isnan().all() and not s.acc_k[1][:, :, :8].isnan().any()


P, G = 80, 24


def _run(bundled, **overrides) -> tuple[float, Counters, Scout | None]:
    """Eval-mode perplexity of scout (or full, with no overrides) on the bundled model."""
    from kvbench.strategies import NoParams
    from kvbench.strategies.full import Full

    spec, model = bundled.model.spec, bundled.model
    rows = token_rows(bundled.encode(read_text("")), 1, P + G + 1, spec.vocab)
    c = Counters(spec.n_kv_heads, 4)
    ctx = RunContext(spec, spec.n_layers, 1, P + G + 1, torch.float32, CPU, CPU, c, model)
    s = Scout(dataclasses.replace(ScoutParams(), **overrides), ctx) if overrides else Full(
        NoParams(), ctx)
    model.setup(s, c, P + G + 1)
    o = decode_run(model, s, rows, G, "eval", lambda: None)
    return math.exp(sum(o.nll) / len(o.nll)), c, s if overrides else None


@pytest.fixture(scope="module")
def full(bundled) -> float:
    return _run(bundled)[0]


def _per_layer(c: Counters, quantity: str) -> dict[int, float]:
    return {layer: sum(v.values()) / len(v) for q, _, layer, v in c.series() if q == quantity}


def test_no_precompute_with_full_budget_equals_full(bundled, full) -> None:
    """One resident block, a budget covering the context: most blocks are attended on the
    host, with the real query (no precompute): exact."""
    ppl, c, _ = _run(bundled, budget_tokens=1 << 20, resident_blocks=1, page_size=16,
                     precompute=False)
    assert abs(ppl / full - 1) < 1e-4
    assert min(_per_layer(c, "cpu_ratio").values()) > 0.5  # the host did most of it
    assert not _per_layer(c, "q_cosine")  # nothing predicted


def test_precompute_error_is_reported_per_layer(bundled, full) -> None:
    """Same setting with the predicted query on the host: not exact, and the cosine of
    predicted vs real query is recorded for every sparse layer (layers 2..29); --pred-error:
    so is the output's error against the real query's (every block selected by both here)."""
    ppl, c, _ = _run(bundled, budget_tokens=1 << 20, resident_blocks=1, page_size=16,
                     pred_error=True)
    assert ppl / full - 1 > 1e-3
    cos = _per_layer(c, "q_cosine")
    assert sorted(cos) == list(range(2, 30))
    assert all(0.5 < x < 1 for x in cos.values())
    err = _per_layer(c, "pred_error")
    assert sorted(err) == list(range(2, 30))
    assert all(0 < x < 1 for x in err.values())
    assert set(_per_layer(c, "pred_overlap").values()) == {1.0}


def test_recall_lowers_the_cpu_ratio_and_calibrates(bundled, tmp_path: Path) -> None:
    """Without recall the host's share grows as blocks leave the window; recall every step
    keeps it lower. A calibration run writes R_l per layer for this model."""
    f = tmp_path / "r.json"
    common = dict(budget_tokens=64, page_size=16, dense_layers=1)
    _, off, _ = _run(bundled, recall=False, calibrate_recall=str(f), **common)
    _, on, s = _run(bundled, recall_interval=1, **common)
    mean = [sum(_per_layer(c, "cpu_ratio").values()) for c in (off, on)]
    assert mean[1] < mean[0]
    assert on.step_total("pages", "recalled", G) >= 0 and sum(
        v for q, w, _, steps in on.series() if (q, w) == ("pages", "recalled")
        for v in steps.values()) > 0
    assert all(int(r.sum(-1).max()) <= s.p.resident for r in s.res.values())
    doc = json.loads(f.read_text())
    assert doc["model"] == "smollm2-135m" and doc["layers"] == 30
    assert doc["intervals"][0] == 0 and all(1 <= r <= G for r in doc["intervals"][1:])
    assert _scout_recall.load(str(f), "smollm2-135m", 30) == doc["intervals"]
    with pytest.raises(KvbenchError, match="calibrated for smollm2-135m with 30 layers"):
        _scout_recall.load(str(f), "smollm2-135m", 3)


def test_intervals_rule() -> None:
    """R_l: steps before the ratio first exceeds tau (at least 1), all steps when never."""
    r, censored = _scout_recall.intervals(
        [[], [0.05, 0.1, 0.13, 0.2], [0.2, 0.1], [0.01, 0.02, 0.03], [0.12, 0.121]], 0.12)
    assert r == [0, 2, 1, 3, 1] and censored == [3]


TINY = ["--model", "smollm2-135m", "--weights", "random", "--layers", "3", "--prompt-len",
        "40", "--gen-len", "4"]


def _cli(args: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(["run", "scout", *TINY, *args])
    return e.value.code, capsys.readouterr().err.strip()


def _foreign(tmp_path: Path) -> str:
    f = tmp_path / "foreign.json"
    f.write_text(json.dumps({"kind": _scout_recall.KIND, "model": "opt-6.7b", "layers": 32,
                             "intervals": [0] * 2 + [8] * 30}))
    return str(f)


@pytest.mark.parametrize("args, message", [
    (["--budget-tokens", "16"], "--budget-tokens 16: smaller than one page of 32 tokens"),
    (["--block-size", "0"], "--page-size 0: must be at least 1"),
    (["--tau", "0"], "--tau 0.0: must be in (0, 1)"),
    (["--tau", "1.5"], "--tau 1.5: must be in (0, 1)"),
    (["--recall-intervals", "FOREIGN"], "was calibrated for opt-6.7b with 32 layers; this "
                                        "run is smollm2-135m with 3 layers"),
    (["--recall-intervals", "/nonexistent.json"], "no such file"),
    (["--calibrate-recall", "OUT"], "random weights the predicted query's cosine and the "
                                    "block ranking are meaningless"),
    # checked before the run (it used to end in a traceback when the run had ended)
    (["--calibrate-recall", "/proc/nope/r.json"], "--calibrate-recall '/proc/nope/r.json': "
                                                  "folder '/proc/nope' does not exist"),
    (["--calibrate-recall", "/proc/r.json"], "--calibrate-recall '/proc/r.json': cannot "
                                             "write in '/proc'"),
])
def test_bad_input_exits_2(args: list[str], message: str, capsys, tmp_path: Path) -> None:
    args = [_foreign(tmp_path) if a == "FOREIGN" else str(tmp_path / "r.json") if a == "OUT"
            else a for a in args]
    out = tmp_path / "x.jsonl"
    assert_usage_error(cli(["run", "scout", *TINY, *args, "--out", str(out)], capsys), message)
    assert not out.exists() and not (tmp_path / "r.json").exists()


def test_run_records(capsys, tmp_path: Path) -> None:
    """`kvbench run scout`: the breakdown carries the host's share per step, the predicted
    query's cosine (waived: random weights), the accelerator's idle share and the
    parameters' open choices."""
    out = tmp_path / "x.jsonl"
    code, _ = _cli(["--budget-tokens", "32", "--page-size", "8", "--dense-layers", "1",
                    "--recall-interval", "2", "--out", str(out)], capsys)
    assert code == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    runs = {r["metric"]: r for r in recs if r.get("kind") == "run"}
    assert {"cpu_compute_ratio_per_step", "query_cosine", "accel_idle_share"} <= set(runs)
    assert runs["query_cosine"]["status"] == "waived"  # random weights
    p = runs["tbt"]["params"]
    assert p["topk_per"] == "kv" and p["interval_mean"] == 2.0 and p["precompute"] is True
    assert p["layer0"] and p["accel_blocks"]


@pytest.mark.gpu
def test_cuda_no_precompute_equals_full() -> None:
    """On a GPU: pinned host KV, the worker's output merged on the device, recall on the
    side stream; with the real query on the host the NLLs equal full attention's."""
    from kvbench.models.weights import load
    from kvbench.strategies import NoParams
    from kvbench.strategies.full import Full

    cuda = torch.device("cuda")
    model = load(SPEC, "random", 3, torch.float32, cuda, seed=1).model
    rows = torch.randint(0, 100, (2, 90), generator=torch.Generator().manual_seed(0)).to(cuda)
    nll = []
    for s_params in (None, ScoutParams(budget_tokens=1 << 20, page_size=8, resident_blocks=2,
                                       dense_layers=1, precompute=False, recall_interval=3)):
        c = RunContext(SPEC, 3, 2, 90, torch.float32, cuda, CPU, Counters(2, 4, cuda=True),
                       model)
        s = Full(NoParams(), c) if s_params is None else Scout(s_params, c)
        model.setup(s, c.counters, 90)
        nll.append(decode_run(model, s, rows, 40, "eval", torch.cuda.synchronize).nll)
    assert max(abs(a - b) for a, b in zip(*nll, strict=True)) < 1e-4


def test_host_part_runs_beside_the_accelerator_in_the_trace() -> None:
    """Fig. 4: the host's attention over the blocks it holds and the accelerator's over the
    resident ones run concurrently: in the stage graph neither waits for the other, and
    the layer's later work waits for both (hints for `kvbench project`)."""
    g = torch.Generator().manual_seed(1)
    s = Scout(ScoutParams(budget_tokens=16, page_size=4, resident_blocks=1, dense_layers=1,
                          recall=False), _ctx(40))
    k, v = torch.randn(2, 2, 22, 8, generator=g), torch.randn(2, 2, 22, 8, generator=g)
    s.prefill(1, torch.randn(2, 6, 22, 8, generator=g), k, v)
    s.ctx.model.q = torch.randn(2, 6, 1, 8, generator=g)
    c = s.ctx.counters
    s.begin_step(1)
    c.step = 1
    s.layer_input(0, torch.zeros(2, 1, 48))
    c.layer = 1
    s.decode(1, s.ctx.model.q, torch.randn(2, 2, 1, 8, generator=g),
             torch.randn(2, 2, 1, 8, generator=g))
    c.settle()  # the step's tensor counts (attend_selected's) are read at its end
    tasks = [t for t in c.graph.tasks if t.step == 1]

    host = [t.id for t in tasks if t.resource == "host" and t.op == "compute"]
    accel = [t.id for t in tasks if t.resource == "accel" and t.work.get("flops")]
    assert host and accel
    up = {i: ancestors(c.graph.tasks, i) for i in host + accel}
    assert all(h not in up[a] and a not in up[h] for h in host for a in accel)
    merge = next(t for t in tasks if t.op == "bookkeeping.merge")
    assert set(host + accel) <= ancestors(c.graph.tasks, merge.id)


@pytest.mark.parametrize("rule", ["score", "lru"])
def test_recall_into_free_room_evicts_every_block_outside_the_top_set(rule: str) -> None:
    """Room for C = 4 blocks, 3 resident: a recall of the real query's top 4 fills the free
    slot and evicts max(0, missing - free) resident blocks outside the top set, which is
    all of them (|top| = C, so missing - free = |resident - top|): the eviction rule
    (--recall-evict) never decides which; the h2d bytes are the recalled blocks' K and V."""
    s, k, g = _prefilled(ScoutParams(budget_tokens=20, page_size=4, resident_blocks=4,
                                     dense_layers=1, recall_evict=rule), 30, seed=9)
    ws = s.win[1]
    assert ws >= 6
    s.res[1][:, :, :ws] = False
    s.res[1][:, :, :3] = True
    q = torch.randn(2, 6, 1, 8, generator=g)
    s._recall(1, q)
    for b in range(2):
        for kh in range(2):
            blocks = [k[b, kh, p * 4:(p + 1) * 4] for p in range(ws)]
            scores = [sum(_bound(q[b, h, 0], x) for h in range(3 * kh, 3 * kh + 3))
                      for x in blocks]
            target = _top(scores, 4)
            assert max(0, len(target - {0, 1, 2}) - 1) == len({0, 1, 2} - target)
            assert set(s.res[1][b, kh, :ws].nonzero().flatten().tolist()) == target, (b, kh)
    recalled = s.ctx.counters.step_total("pages", "recalled", 0)
    assert recalled > 0
    assert s.ctx.counters.step_total("bytes_moved", "h2d.recall", 0) == 2 * recalled * 4 * 8 * 4
