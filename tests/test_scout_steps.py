"""ScoutAttention's decode steps through a whole model (issue 30): what each sparse layer's
step files, tied together as the algorithm ties them (the current token stored to the host,
the query and the host's block ids sent wherever a selection is issued, without a read
on the launching thread, the host's output and lse back, the host's
share of the budget equal to the host tokens over the budget, each recall's blocks over the
recall link), for the predicted and the real query; the dense layers read everything; the
mask of the last step covers the budget."""

from __future__ import annotations

import pytest
import torch

from kvbench.models import ModelSpec
from kvbench.models.weights import load
from kvbench.runtime.context import Counters, RunContext
from kvbench.runtime.run import decode_run
from kvbench.strategies.scout import Scout, ScoutParams

CPU = torch.device("cpu")
SPEC = ModelSpec("tiny-gqa-4l", "llama", 4, 6, 2, 48, 96, 100, 160, head_dim=20)
B, HQ, HKV, D, P, STEPS, S, BUDGET = 3, 6, 2, 20, 40, 8, 4, 16  # B told from Hkv


@pytest.mark.parametrize("precompute", [True, False])
def test_each_sparse_step_files_its_host_part_and_recalls(precompute: bool) -> None:
    model = load(SPEC, "random", 4, torch.float32, CPU, seed=11).model
    c = Counters(HKV, 4, False, 4)
    n = P + STEPS + 1
    ctx = RunContext(SPEC, 4, B, n, torch.float32, CPU, CPU, c, model)
    s = Scout(ScoutParams(budget_tokens=BUDGET, page_size=S, dense_layers=1,
                          precompute=precompute, recall_interval=2), ctx)
    model.setup(s, c, n)
    rows = torch.randint(0, SPEC.vocab, (B, P), generator=torch.Generator().manual_seed(12))
    decode_run(model, s, rows, STEPS, "generate", lambda: None)
    series = {(q, w, layer): v for q, w, layer, v in c.series()}

    def at(q: str, w: str, layer: int, step: int) -> float:
        return series.get((q, w, layer), {}).get(step, 0.0)

    host_steps = recalls = 0
    for step in range(1, STEPS + 1):
        n_tot = P + step
        host = {layer: at("tokens", "host", layer, step) / B for layer in (1, 2, 3)}
        # the query and the host's block ids [B, Hkv, budget / S] (int64) go to the host
        # where the layer's selection is issued, whether the host then attends anything
        # or not (its worker finds out): with precompute at the previous layer's input
        # (the predicted query), else at the layer itself
        sent = {layer: B * HQ * D * 4.0 + B * HKV * (BUDGET // S) * 8.0
                if layer + precompute in (1, 2, 3) else 0.0 for layer in range(4)}
        assert at("tokens", "accel", 0, step) == B * n_tot  # the dense layer
        assert at("bytes_moved", "d2h", 0, step) == sent[0]
        for layer in (1, 2, 3):
            host_steps += host[layer] > 0
            assert at("cpu_ratio", "host", layer, step) == pytest.approx(
                host[layer] / min(BUDGET, n_tot))
            assert at("bytes_moved", "d2h", layer, step) == 2.0 * B * HKV * D * 4 + sent[layer]
            assert at("bytes_moved", "h2d", layer, step) == (
                B * HQ * D * 4 + 4.0 * B * HQ if host[layer] else 0.0)
            recalled = at("pages", "recalled", layer, step)
            recalls += recalled > 0
            assert at("bytes_moved", "h2d.recall", layer, step) == 2.0 * recalled * S * D * 4
            tokens = at("tokens", "accel", layer, step) / B + host[layer]
            assert 0 < tokens <= BUDGET + S  # the budget's blocks (the current one partly)
    assert host_steps and recalls
    phases = {w for (q, w, _layer) in series if q == "time"}
    assert phases == {"accel_idle", "attention", "bookkeeping.merge", "bookkeeping.recall",
                      "host_attention"} | ({"bookkeeping.predict"} if precompute else set())
    waits = [v for (q, w, _layer), st in series.items() if q == "time"
             and w in ("accel_idle", "host_attention") for v in st.values()]
    assert all(0 <= x < 60 for x in waits)  # seconds, not clock readings
    for layer in (1, 2, 3):
        mask = s.attended(layer)
        assert mask.dtype == torch.bool and tuple(mask.shape) == (B, HQ, n - 1)
        assert bool(mask[:, :, -1].all()) and bool((mask.sum(-1) <= BUDGET).all())
    dense = s.attended(0)
    assert dense.dtype == torch.bool and tuple(dense.shape) == (B, HQ, n - 1)
    assert bool(dense.all())


@pytest.mark.parametrize("precompute", [True, False])
@pytest.mark.parametrize("interval", [2, 3])
def test_only_recall_steps_read_the_device(precompute: bool, interval: int) -> None:
    """The launching thread of a decode step reads no device value (the host attention's
    inputs reach its worker, which finds out itself whether it has work), but on a recall
    step: one nonzero for the blocks to copy in and one for those evicted, per sparse layer
    (Scout.host_reads). Counted as every run counts a step (kvbench.runtime.opcount): the
    step after STEPS, a recall step for interval 3 (step 9) and not for 2; the host
    attended in it."""
    from kvbench.runtime.opcount import count_step

    model = load(SPEC, "random", 4, torch.float32, CPU, seed=11).model
    c = Counters(HKV, 4, False, 4)
    n = P + STEPS + 2
    ctx = RunContext(SPEC, 4, B, n, torch.float32, CPU, CPU, c, model)
    s = Scout(ScoutParams(budget_tokens=BUDGET, page_size=S, dense_layers=1,
                          precompute=precompute, recall_interval=interval), ctx)
    model.setup(s, c, n)
    rows = torch.randint(0, SPEC.vocab, (B, P), generator=torch.Generator().manual_seed(12))
    out = decode_run(model, s, rows, STEPS, "generate", lambda: None)
    counted = count_step(model, s, out.tokens, lambda: None)
    assert c.step == STEPS + 1
    recall = (STEPS + 1) % interval == 0
    assert dict(counted.syncs_by_op) == ({"aten.nonzero_numpy": 6} if recall else {})
    assert Scout.host_reads[0] == 2
    assert c.step_total("tokens", "host", STEPS + 1) > 0
