"""One accelerator-budget vocabulary (issue 11 item 11), fit checks that match what the
strategies allocate and counters that count every step (item 6), and hgca's defaults that
keep its window a ring of several blocks (item 16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_usage_error, cli

from kvbench.cli import main
from kvbench.models import get_spec
from kvbench.runtime.breakdown import derived
from kvbench.runtime.context import Counters, RunContext
from kvbench.strategies import STRATEGIES, NoParams
from kvbench.strategies.arkvale import ArkValeParams
from kvbench.strategies.h2o import H2OParams
from kvbench.strategies.hgca import HgcaParams
from kvbench.strategies.quest import QuestParams
from kvbench.strategies.streaming import StreamingParams

SPEC = get_spec("smollm2-135m")  # 9 query heads, 3 KV heads, head dim 64
CPU = torch.device("cpu")
BUDGETED = ("h2o", "streaming", "hgca")


def context(max_len: int = 80, batch: int = 2, layers: int = 2,
            dtype: torch.dtype = torch.float32, metrics: tuple = ()) -> RunContext:
    return RunContext(SPEC, layers, batch, max_len, dtype, CPU, CPU,
                      Counters(SPEC.n_kv_heads, dtype.itemsize, metrics=metrics))


def drive(s, p: int = 40, g: int = 6, seed: int = 0) -> list[torch.Tensor]:
    """Prefill p random tokens, then g decode steps, every layer; the last layer's outputs."""
    gen = torch.Generator().manual_seed(seed)
    b, dt = s.ctx.batch, s.ctx.dtype
    outs = []
    for step in range(g + 1):
        t = p if step == 0 else 1
        q, k, v = (torch.randn(b, h, t, SPEC.head_dim, generator=gen).to(dt)
                   for h in (SPEC.n_heads, SPEC.n_kv_heads, SPEC.n_kv_heads))
        s.ctx.counters.step = step
        s.begin_step(step)
        for layer in range(s.ctx.n_layers):
            s.ctx.counters.layer = layer
            out = (s.prefill if step == 0 else s.decode)(layer, q, k, v)
        outs.append(out)
    for L in getattr(s, "layers", []):
        s._join(L)
    return outs


def held_bytes(obj, seen: set[int] | None = None) -> int:
    """Bytes of every tensor storage reachable from a strategy's state (lists, per-layer
    objects), each storage once; the run context (model, counters) is not the strategy's."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        if st.data_ptr() in seen:
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()
    if isinstance(obj, (list, tuple)):
        return sum(held_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(held_bytes(x, seen) for x in obj.values())
    if hasattr(obj, "__dict__") and not isinstance(obj, (RunContext, type)):
        return sum(held_bytes(v, seen) for k, v in vars(obj).items() if k != "ctx")
    return 0


@pytest.mark.parametrize("name", BUDGETED)
def test_one_option_name_for_the_accelerator_budget(name: str, capsys) -> None:
    """h2o, streaming and hgca take --gpu-share and --gpu-tokens (the old --budget is a
    hidden alias: not in --help)."""
    with pytest.raises(SystemExit) as e:
        main(["run", name, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--gpu-share" in text and "--gpu-tokens" in text and "--budget " not in text


@pytest.mark.parametrize("name", ["h2o", "streaming"])
def test_old_budget_spelling_is_an_alias_of_gpu_share(name: str, capsys,
                                                      tmp_path: Path) -> None:
    assert_usage_error(cli(["run", name, "--budget", "1.5", "--out", str(tmp_path / "x.jsonl")],
                           capsys), "--gpu-share 1.5: must be in (0, 1]")


@pytest.mark.parametrize("name, params, tokens", [
    ("h2o", H2OParams(gpu_tokens=20), 20),
    ("h2o", H2OParams(gpu_share=0.25), 20),
    ("streaming", StreamingParams(gpu_tokens=24), 24),
    ("streaming", StreamingParams(gpu_share=0.3), 24),
    ("hgca", HgcaParams(gpu_tokens=24, block=8), 24),
])
def test_gpu_tokens_and_share_mean_the_same(name: str, params, tokens: int) -> None:
    s = STRATEGIES.get(name)(params, context(80))
    assert (s.w if name == "hgca" else s.budget) == tokens


@pytest.mark.parametrize("name, params, dtype", [
    ("full", NoParams(), torch.float32),
    ("offload", NoParams(), torch.float32),
    ("h2o", H2OParams(gpu_share=0.25), torch.float32),
    ("h2o", H2OParams(gpu_tokens=16), torch.float32),
    ("streaming", StreamingParams(gpu_share=0.3), torch.float32),
    ("hgca", HgcaParams(gpu_share=0.25, alpha=0.1), torch.float32),
    ("hgca", HgcaParams(gpu_tokens=16, block=8, alpha=0.1), torch.float32),
    ("hgca", HgcaParams(gpu_tokens=16, block=8, alpha=0.1), torch.float16),
    ("quest", QuestParams(budget_tokens=32, page_size=8, dense_layers=1), torch.float32),
    ("quest", QuestParams(variant="kernel", budget_tokens=24, page_size=16, dense_layers=0,
                          topk_per="kv"),
     torch.float16),
    ("arkvale", ArkValeParams(budget_tokens=32, page_size=8, sinks=1, window_pages=1,
                              dense_layers=1), torch.float32),
    ("arkvale", ArkValeParams(budget_tokens=1 << 20, page_size=8, dense_layers=1),
     torch.float16),
])
def test_fit_check_counts_what_the_strategy_allocates(name: str, params, dtype) -> None:
    """`placement` (what the fit check refuses a run by) equals the bytes the strategy
    holds after a prefill and decode steps: hgca's host KV_cpu + KV_ctx in float32 for a
    float16 model, its MAW, its window (not the whole cache) with --gpu-tokens, offload's
    staging buffers, arkvale's page pool (at most the cache's pages, whatever the budget),
    digests and host backup."""
    cls = STRATEGIES.get(name)
    ctx = context(80, dtype=dtype)
    s = cls(params, ctx)
    drive(s)
    need = cls.placement(params, ctx)
    assert need["accel"] + need["host"] == held_bytes(s)
    if name in ("offload", "hgca"):
        assert need["accel"] > 0 and need["host"] > 0


def test_fit_check_reports_placement(tmp_path: Path) -> None:
    from kvbench.runtime.run import RunConfig, check_fit

    cfg = RunConfig(prompt_len=64, gen_len=15)
    p = HgcaParams(gpu_tokens=32, block=16)
    fit = check_fit(SPEC, 2, cfg, STRATEGIES.get("hgca"), p, CPU, torch.float32)
    want = STRATEGIES.get("hgca").placement(p, context(80, batch=1))
    assert (fit["accel_bytes"], fit["host_bytes"]) == (want["accel"], want["host"])


def test_hgca_counts_host_entries_on_steps_without_a_selection() -> None:
    """A beta so high that nothing is selected: every decode step with host entries still
    counts them, so the selected fraction is 0 (not missing, and never inflated by
    leaving out such steps)."""
    hgca = STRATEGIES.get("hgca")
    s = hgca(HgcaParams(gpu_tokens=16, block=8, beta=1e9, keep_min=0),
             context(80, metrics=hgca.metrics))  # the engine's counters know its figures
    drive(s)
    c = s.ctx.counters
    n_host = s.layers[0].n_host
    assert n_host > 0 and int(s.layers[0].lens.sum()) == 0
    for step in range(1, 7):
        assert c.step_total("tokens", "host_resident", step) >= 2 * 2 * 24
    rec = next(r for r in derived("hgca", {"layers": 2, "batch": 2}, [1.0] * 6, c)
               if r.metric == "selected_fraction")
    assert rec.value == 0.0


def test_hgca_host_output_bytes_in_the_host_dtype() -> None:
    """float16 model: the host part computes in float32, so its output [B, Hq, 1, D] and
    lse [B, Hq, 1] cross the h2d link as 4-byte values."""
    s = STRATEGIES.get("hgca")(HgcaParams(gpu_tokens=16, block=8, beta=0.0),
                               context(80, dtype=torch.float16, layers=1))
    drive(s)
    b, hq, d = 2, SPEC.n_heads, SPEC.head_dim
    assert s.ctx.counters.step_total("bytes_moved", "h2d", 3) == b * hq * (d * 4 + 4)


def test_hgca_default_block_keeps_a_ring_of_blocks() -> None:
    """The CPU default lengths (prompt 256 + 32): a 0.25 share is 72 tokens, one block of
    64; the automatic block is 16 (4 blocks). An explicit --block 64 runs, warned."""
    hgca = STRATEGIES.get("hgca")
    p, notes = hgca.for_run(HgcaParams(), 289)
    assert (p.block, p.window(289), p.window_blocks, notes) == (16, 64, 4, [])
    p, notes = hgca.for_run(HgcaParams(block=64), 289)
    assert p.window_blocks == 1 and "outside the paper's regime" in notes[0]
    p, _ = hgca.for_run(HgcaParams(), 2049)  # HGCA Table 1 lengths keep block 64
    assert (p.block, p.window_blocks) == (64, 8)
    assert hgca.for_run(HgcaParams(gpu_tokens=48), 289)[0].block == 8


@pytest.mark.parametrize("block, blocks, warned", [(None, 4, False), (64, 1, True)])
def test_hgca_run_says_its_window_blocks(block, blocks, warned, capsys,
                                         tmp_path: Path) -> None:
    """`kvbench run hgca` at the default lengths: records carry the window's blocks, and a
    window under four blocks warns on stderr."""
    out = tmp_path / "r.jsonl"
    args = ["run", "hgca", "--model", "opt-125m", "--weights", "random", "--layers", "1",
            "--gen-len", "2", "--prompt-len", "286", "--out", str(out)]
    with pytest.raises(SystemExit) as e:
        main(args + (["--block", str(block)] if block else []))
    assert e.value.code == 0
    assert ("warning:" in capsys.readouterr().err) == warned
    recs = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    assert {r["params"]["window_blocks"] for r in recs} == {blocks}
    assert {r["params"]["block"] for r in recs} == {block or 16}
