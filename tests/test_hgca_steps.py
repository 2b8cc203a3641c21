"""HGCA's decode steps through a whole model (issue 30): what each step files per layer,
computed in the test from the layer's state before the step (the ring's entries, the host
entries, each KV_ctx row's length): the window attended on the accelerator, the query to the
host and the host part's output back when a row selected entries, the oldest block evicted
(K, V and MAW) when the ring fills, the host entries resident and selected; the phases the
run times; the mask of the last step."""

from __future__ import annotations

import pytest
import torch

from kvbench.models import ModelSpec
from kvbench.models.weights import load
from kvbench.runtime.context import Counters, RunContext
from kvbench.runtime.run import decode_run
from kvbench.strategies.hgca import Hgca, HgcaParams

CPU = torch.device("cpu")
PHASES = {v: {"attention", "accel_idle", "bookkeeping.evict", "bookkeeping.issue",
              "bookkeeping.maw", "bookkeeping.merge", "bookkeeping.handoff",
              "bookkeeping.select", "bookkeeping.scores"} for v in ("authors", "union-ema")}
SPEC = ModelSpec("tiny-gqa-4l", "llama", 4, 6, 2, 48, 96, 100, 160, head_dim=20)
B, HQ, HKV, D, STEPS, W, BLOCK = 2, 6, 2, 20, 10, 8, 4


@pytest.mark.parametrize("prompt", [24, 6])  # 6: no host entry before the ring first fills
@pytest.mark.parametrize(("variant", "beta"), [("authors", 0.5), ("union-ema", 0.01)])
def test_each_decode_step_files_its_window_host_part_and_eviction(variant: str, beta: float,
                                                                   prompt: int) -> None:
    model = load(SPEC, "random", 4, torch.float32, CPU, seed=7).model
    c = Counters(HKV, 4, False, 4)
    n = prompt + STEPS + 1
    ctx = RunContext(SPEC, 4, B, n, torch.float32, CPU, CPU, c, model)
    extra = {"keep_min": 2} if variant == "authors" else {}
    s = Hgca(HgcaParams(variant=variant, gpu_tokens=W, block=BLOCK, beta=beta, cpu_threads=1,
                        **extra), ctx)
    assert s.w == W
    model.setup(s, c, n)
    before: list[list[tuple]] = []

    def settle() -> None:  # the worker's selections joined: each layer's state
        state = []
        for L in s.layers:
            s._join(L)
            state.append((L.n, L.n_host, L.lens.clone(), L.ulens.clone()))
            if variant == "union-ema":  # the newest entry's MAW started at 0: alpha * weight
                assert float(L.maw[:, :, (L.tail + L.n - 1) % W].max()) <= s.p.alpha
        before.append(state)

    rows = torch.randint(0, SPEC.vocab, (B, prompt),
                         generator=torch.Generator().manual_seed(8))
    decode_run(model, s, rows, STEPS, "generate", lambda: None,
               lambda: bool(settle()) and False)
    series = {(q, w, layer): v for q, w, layer, v in c.series()}

    def at(q: str, w: str, layer: int, step: int) -> float:
        return series.get((q, w, layer), {}).get(step, 0.0)

    evictions = host_steps = 0
    for step in range(2, STEPS + 1):  # state before step t: what settle saw after t - 1
        for layer, (n_res, n_host, lens, ulens) in enumerate(before[step - 2]):
            nmax = int(lens.max()) if n_host else 0
            full = n_res + 1 == W
            evictions += full
            host_steps += nmax > 0
            q_bytes = B * HQ * D * 4 if nmax else 0.0
            back = B * HQ * D * 4 + B * HQ * 4 if nmax else 0.0
            block = 2 * B * HKV * BLOCK * D * 4 + B * HQ * BLOCK * 4 if full else 0.0
            assert at("tokens", "accel", layer, step) == B * (n_res + 1)
            assert at("bytes_moved", "d2h", layer, step) == q_bytes + block, (step, layer)
            assert at("bytes_moved", "h2d", layer, step) == back, (step, layer)
            mean = float(lens.sum()) / lens.numel() if nmax else 0.0  # entries per row
            assert at("tokens", "host", layer, step) == pytest.approx(B * mean)
            # q.k and p.v of every query head over its row's entries; the KV heads' copies
            # (their rows' unions) read once for their groups
            assert at("flops", "host", layer, step) == pytest.approx(4.0 * B * HQ * mean * D)
            assert at("bytes_read", "host", layer, step) == \
                (2.0 * int(ulens.sum()) * D * 4 if nmax else 0.0)
            assert at("tokens", "host_resident", layer, step) == B * n_host
            per_row = lens.view(B, -1).sum(0).tolist() if n_host else []
            for h, got in enumerate(per_row):
                assert at("tokens", f"host_selected.h{h}", layer, step) == got
    assert evictions and host_steps  # both paths ran
    if prompt < W:
        assert any(state[1][1] == 0 for state in before)  # steps without host entries
    phases = {w for (q, w, _layer) in series if q == "time"}
    assert phases == PHASES[variant]
    worker = [v for (q, w, _layer), st in series.items() if q == "time"
              and w == "bookkeeping.select" for v in st.values()]
    assert worker and all(0 < x < 60 for x in worker)  # seconds of the worker's selections
    # the host's attention follows the query's copy to the host (one fork of the layer)
    tasks = [t for t in c.graph.tasks if t.step == STEPS]
    for layer in range(4):
        (att,) = [t for t in tasks if t.layer == layer and t.op == "attention"
                  and t.resource == "host"] or [None]
        if att is not None:
            (copy,) = [t for t in tasks if t.layer == layer and t.resource == "d2h"
                       and t.work["bytes_moved"] == B * HQ * D * 4]
            assert copy.id in att.after
            # the task reads the copies and the query, writes the output
            assert att.work["bytes_written"] == B * HQ * D * 4
            assert att.work["bytes_read"] == at("bytes_read", "host", layer, STEPS) \
                + B * HQ * D * 4
    for layer in range(4):
        mask = s.attended(layer)
        L = s.layers[layer]
        nh, nw = L.seen
        assert mask.dtype == torch.bool and tuple(mask.shape) == (B, HQ, nh + nw)
        assert bool(mask[:, :, nh:].all())
        # the KV_ctx entries the step saw (the step's own eviction adds newer positions),
        # row by row: a query head attends its row's entries, no other position
        seen = sum(int((L.cpos[r, :int(L.lens[r])] < nh).sum()) for r in range(L.lens.numel()))
        assert int(mask[:, :, :nh].sum()) == seen * (HQ // (L.lens.numel() // B))
        per = L.lens.numel() // B  # rows a sequence
        for r in range(L.lens.numel()):
            want = torch.zeros(nh, dtype=torch.bool)
            got = L.cpos[r, :int(L.lens[r])].long()
            want[got[got < nh]] = True
            b, j = divmod(r, per)
            heads = range(j * HQ // per, (j + 1) * HQ // per)
            assert all(torch.equal(mask[b, h, :nh], want) for h in heads), (layer, r)


def test_the_cpu_worker_runs_on_itself_alone() -> None:
    """On a CPU-only run the selection worker's torch ops and native calls take one thread
    (kvbench.kernels.cpu.helper_thread): a worker opening two-thread OpenMP regions put more
    OpenMP threads than CPUs in the process and slowed every native call of the caller. The
    caller keeps its own team size."""
    from kvbench.kernels import cpu
    from kvbench.native import lib

    if cpu._lib() is None:
        pytest.skip("native library not built")
    model = load(SPEC, "random", 4, torch.float32, CPU, seed=7).model
    c = Counters(HKV, 4, False, 4)
    ctx = RunContext(SPEC, 4, B, 40, torch.float32, CPU, CPU, c, model)
    s = Hgca(HgcaParams(gpu_tokens=W, block=BLOCK), ctx)
    mine = lib().kvb_omp_threads(0)
    seen = s.worker.submit(lambda: (lib().kvb_omp_threads(0), cpu.default_threads())).result()
    assert seen == (1, 1)
    assert lib().kvb_omp_threads(0) == mine and cpu.default_threads() >= 1
    s.worker.shutdown()


@pytest.mark.parametrize("native", [True, False])
def test_exact_hgca_decodes_as_full_attention_while_its_ring_wraps(native: bool,
                                                                    monkeypatch) -> None:
    """At beta 0 every evicted entry is selected, so each decode step's logits are full
    attention's, through steps whose resident window is one range and steps where the ring
    has wrapped into two (the native kernel: the wrapped slots as one selection; torch: the
    two ranges merged by lse)."""
    from kvbench.kernels import cpu
    from kvbench.strategies import NoParams
    from kvbench.strategies.full import Full

    if not native:
        monkeypatch.setattr(cpu, "native_ok", lambda q: False)
    prompt, steps = 6, 14
    n = prompt + steps + 1
    tokens = torch.randint(0, SPEC.vocab, (B, n), generator=torch.Generator().manual_seed(3))
    logits, wrapped = [], 0
    for make in (lambda ctx: Full(NoParams(), ctx),
                 lambda ctx: Hgca(HgcaParams(gpu_tokens=W, block=BLOCK, beta=0.0,
                                             cpu_threads=1), ctx)):
        model = load(SPEC, "random", 4, torch.float32, CPU, seed=7).model
        c = Counters(HKV, 4, False, 4)
        ctx = RunContext(SPEC, 4, B, n, torch.float32, CPU, CPU, c, model)
        s = make(ctx)
        model.setup(s, c, n)
        got = [model(tokens[:, :prompt], 0)]
        for t in range(prompt, prompt + steps):
            if isinstance(s, Hgca):
                for L in s.layers:
                    s._join(L)  # the worker's selections in before the step
                wrapped += len(s.layers[0].resident()) == 2
            got.append(model(tokens[:, t:t + 1], t))
        logits.append(torch.stack(got))
    assert wrapped >= 3  # steps over a wrapped ring, and others over one range
    assert torch.allclose(logits[1], logits[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", ["authors", "union-ema"])
def test_the_torch_maw_update_is_the_native_ones(variant: str, monkeypatch) -> None:
    """Line 8 in torch ops (CUDA, or no native build) and in one native call (probes/maw.c)
    leave the same moving averages after decode steps that evict and select."""
    from kvbench.kernels import cpu

    prompt, steps = 6, 10
    n = prompt + steps + 1
    tokens = torch.randint(0, SPEC.vocab, (B, n), generator=torch.Generator().manual_seed(5))
    maws = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(cpu, "maw_ok", lambda *a: False)
        model = load(SPEC, "random", 4, torch.float32, CPU, seed=7).model
        c = Counters(HKV, 4, False, 4)
        ctx = RunContext(SPEC, 4, B, n, torch.float32, CPU, CPU, c, model)
        s = Hgca(HgcaParams(variant=variant, gpu_tokens=W, block=BLOCK, beta=0.5,
                            alpha=0.3, cpu_threads=1), ctx)
        model.setup(s, c, n)
        model(tokens[:, :prompt], 0)
        for t in range(prompt, prompt + steps):
            model(tokens[:, t:t + 1], t)
        for L in s.layers:
            s._join(L)
        maws.append([(L.tail, L.n, L.maw.clone()) for L in s.layers])
    for (t0, n0, m0), (t1, n1, m1) in zip(*maws, strict=True):
        assert (t0, n0) == (t1, n1)
        assert torch.allclose(m0, m1, atol=1e-6), (m0 - m1).abs().max()
