"""InfiniGen held against the authors' rules (issue 31): snu-comparch/InfiniGen at 3754f52,
accuracy/setup/gen_llama_skewing_matrix.py and gen_partial_weight.py (offline skew and
channels), accuracy/src/modeling_llama_ours.py (`kv_cache_mask`: the speculation rule).

The reference below is a float64 transcription of those rules written for this test:
- A per head: right singular vectors of the head's post-RoPE queries over the first 2048
  tokens of a fixed text (GQA, which their Llama-2 code has no path for: the group's
  queries stacked, one A per KV head, as kvbench's `authors` variant generalises it);
- channels: per head the union of the int(r * D) largest sum |q A| and sum |k A| over a
  separate short prompt;
- each decode row n (n tokens before it) scores the n + 1 tokens (the current one too) with
  the predicted query's channels, thresholds every head at head 0's maximum minus alpha,
  takes the mean count over heads (floored), caps it at the cap, and keeps each head's top
  that many of the n + 1; rows below the cap attend every token.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_usage_error, cli

from kvbench.models import ModelSpec
from kvbench.models.weights import load
from kvbench.runtime.context import Counters, RunContext
from kvbench.strategies import _infinigen_calib as calib
from kvbench.strategies.infinigen import InfiniGen, InfiniGenParams

CPU = torch.device("cpu")
# a context of 160 tokens: the calibration reads the text's first 160 (the authors' 2048
# past a model's context cannot be run)
SPEC = ModelSpec("tiny-gqa-20", "llama", 2, 6, 2, 48, 96, 100, 160, head_dim=20)
B, HQ, HKV, D = 2, 6, 2, 20


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    """One calibration cache (and process memo) for the module's tests."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVBENCH_CACHE", str(tmp_path_factory.mktemp("cache")))
        mp.setattr(calib, "_MEMO", {})
        yield


@pytest.fixture(scope="module")
def model():
    return load(SPEC, "random", 2, torch.float32, CPU, seed=1).model


def _ctx(model, max_len: int = 64) -> RunContext:
    return RunContext(SPEC, 2, B, max_len, torch.float32, CPU, CPU,
                      Counters(SPEC.n_kv_heads, 4), model)


class _Pred:
    """Stands in for the decoder once calibrated: `query` returns the predicted query."""

    q: torch.Tensor

    def query(self, layer: int, x: torch.Tensor, start: int) -> torch.Tensor:
        return self.q


def _captured(model, ctx: RunContext, text: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's post-RoPE (q, k) of `text` (token ids as the calibration reads them)."""
    ids = [t % SPEC.vocab for t in model.encode(text)][:SPEC.ctx]
    got: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.inference_mode():
        calib._run(model, ctx, ids, lambda layer, q, k: got.append((q.double(), k.double())))
    return got


def _ref_calibration(model, ctx: RunContext, text: str, ratio: float
                     ) -> list[tuple[torch.Tensor, list[set[int]]]]:
    """Per layer (A [Hkv, D, D] float64, the union of channels per KV head)."""
    skew_qk = _captured(model, ctx, text)
    prompt_qk = _captured(model, ctx, calib.CHANNEL_TEXT.read_text())
    keep = int(ratio * D)
    out = []
    for (q, _), (pq, pk) in zip(skew_qk, prompt_qk, strict=True):
        a, sets = [], []
        for h in range(HKV):
            rows = torch.cat([q[0, h * 3 + j] for j in range(3)])  # the group's queries
            ah = torch.linalg.svd(rows, full_matrices=False).Vh.T
            qm = sum((pq[0, h * 3 + j] @ ah).abs().sum(0) for j in range(3))
            km = (pk[0, h] @ ah).abs().sum(0)
            sets.append(set(qm.topk(keep).indices.tolist()) | set(km.topk(keep).indices.tolist()))
            a.append(ah)
        out.append((torch.stack(a), sets))
    return out


def test_calibration_is_the_authors_offline_skew_and_channel_union(model) -> None:
    c = _ctx(model)
    s = InfiniGen(InfiniGenParams(dense_layers=1), c)
    ref = _ref_calibration(model, c, calib.CALIB_TEXT.read_text(), 0.2)
    for layer, (a, sets) in enumerate(ref):
        got_a, ch, on = s.skew[layer]
        # singular vectors are defined up to sign: compare |A| column by column
        assert torch.allclose(got_a.double().abs(), a.abs(), atol=2e-4), layer
        for h in range(HKV):
            assert set(ch[h][on[h] > 0].tolist()) == sets[h], (layer, h)
        assert s.part[layer].shape[-1] == max(len(x) for x in sets)
    assert any(len(x) > 4 for _, sets in ref for x in sets)  # a union wider than d' = 4


def test_calibration_comes_from_the_calibration_text_not_the_prompt(model, tmp_path) -> None:
    """authors: the skew is fixed before the prompt and unchanged by it; another
    --calib-text changes it. oracle: the prompt decides it."""
    g = torch.Generator().manual_seed(5)

    def skews(params: InfiniGenParams, scale: float) -> list[torch.Tensor]:
        s = InfiniGen(params, _ctx(model))
        k = torch.randn(B, HKV, 40, D, generator=g)
        s.prefill(1, torch.randn(B, HQ, 40, D, generator=g) * scale, k, k)
        return [sk[0].clone() for sk in s.skew if sk is not None]

    a1, a2 = skews(InfiniGenParams(), 1.0), skews(InfiniGenParams(), 3.0)
    assert all(torch.equal(x, y) for x, y in zip(a1, a2, strict=True))
    other = tmp_path / "other.txt"
    other.write_text("A different calibration text, about ships and harbours. " * 60)
    a3 = skews(InfiniGenParams(calib_text=str(other)), 1.0)
    assert not torch.allclose(a1[1].abs(), a3[1].abs(), atol=1e-2)
    o1 = skews(InfiniGenParams(variant="oracle", skew_tokens=40), 1.0)
    o2 = skews(InfiniGenParams(variant="oracle", skew_tokens=40), 3.0)
    assert not torch.allclose(o1[0].abs(), o2[0].abs(), atol=1e-2)


def test_calibration_is_cached_on_disk(model, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(calib, "_MEMO", {})
    c = _ctx(model)
    first = InfiniGen(InfiniGenParams(), c).skew[1][0]
    assert len(list((tmp_path / "infinigen").glob("*.pt"))) == 1
    monkeypatch.setattr(calib, "_MEMO", {})
    monkeypatch.setattr(calib, "_run", lambda *a: pytest.fail("recomputed"))
    assert torch.equal(InfiniGen(InfiniGenParams(), c).skew[1][0], first)


def _ref_step(a: torch.Tensor, sets: list[set[int]], pred: torch.Tensor, q: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor, alpha: float, cap: int
              ) -> tuple[list[list[set[int]]], torch.Tensor]:
    """The authors' row: pred/q [B, Hq, D], k/v [B, Hkv, n + 1, D] (the current token
    last), float64. Returns the kept positions per (batch, head) and the output."""
    n1 = k.shape[2]
    g = HQ // HKV
    score = torch.zeros(B, HQ, n1, dtype=torch.float64)
    for b in range(B):
        for h in range(HQ):
            kv, c = h // g, sorted(sets[h // g])
            score[b, h] = (k[b, kv] @ a[kv])[:, c] @ (pred[b, h] @ a[kv])[c] / math.sqrt(D)
    if n1 - 1 < cap:
        keep = n1
    else:
        thr = [score[b, 0].max() - alpha for b in range(B)]
        count = sum(int((score[b, h] >= thr[b]).sum()) for b in range(B) for h in range(HQ))
        keep = max(1, min(math.floor(count / (B * HQ)), cap))
    sel = [[set(score[b, h].topk(keep).indices.tolist()) for h in range(HQ)]
           for b in range(B)]
    out = torch.zeros(B, HQ, D, dtype=torch.float64)
    for b in range(B):
        for h in range(HQ):
            t = sorted(sel[b][h])
            w = torch.softmax(k[b, h // g, t] @ q[b, h] / math.sqrt(D), dim=0)
            out[b, h] = w @ v[b, h // g, t]
    return sel, out


@pytest.mark.parametrize("alpha, spread", [(5.0, 1.0), (1.0, 2.5)])
def test_authors_selection_and_output_match_the_reference(model, alpha: float,
                                                          spread: float) -> None:
    """Six decode steps, GQA 6/2, batch 2: the positions each head attends and the output
    equal the reference's; the current token is kept by some heads and dropped by others,
    and at step 4 it is head 0's maximum (its score sets the threshold).
    At alpha 5 and spread 1 the cap (0.2 of the window of 64: 12) decides n', at alpha 1
    and spread 2.5 the threshold does."""
    c = _ctx(model, 64)
    s = InfiniGen(InfiniGenParams(alpha=alpha, dense_layers=1), c)
    c.model = _Pred()
    ref = _ref_calibration(model, _ctx(model), calib.CALIB_TEXT.read_text(), 0.2)[1]
    g = torch.Generator().manual_seed(13)
    scales = torch.linspace(0.3, 3.0, D)
    k = torch.randn(B, HKV, 40, D, generator=g) * scales * spread
    v = torch.randn(B, HKV, 40, D, generator=g)
    s.prefill(1, torch.randn(B, HQ, 40, D, generator=g), k, v)
    ks, vs = k.double(), v.double()
    kept, cur = set(), set()
    for step in range(1, 7):
        c.counters.step = step
        pred = torch.randn(B, HQ, 1, D, generator=g) * scales
        q = pred + 0.3 * torch.randn(B, HQ, 1, D, generator=g)
        kn = torch.randn(B, HKV, 1, D, generator=g) * scales * spread
        if step == 4:  # a current token that is head 0's maximum raises every threshold
            kn[:, 0, 0] = 3 * pred[:, 0, 0]
        vn = torch.randn(B, HKV, 1, D, generator=g)
        c.model.q = pred
        s.layer_input(0, torch.zeros(B, 1, SPEC.hidden))
        out = s.decode(1, q, kn, vn)
        ks, vs = torch.cat([ks, kn.double()], 2), torch.cat([vs, vn.double()], 2)
        sel, want = _ref_step(ref[0], ref[1], pred[:, :, 0].double(), q[:, :, 0].double(),
                              ks, vs, alpha, 12)
        mask = s.attended(1)
        for b in range(B):
            for h in range(HQ):
                assert set(mask[b, h].nonzero().flatten().tolist()) == sel[b][h], (step, b, h)
                cur.add(ks.shape[2] - 1 in sel[b][h])
                kept.add(len(sel[b][h]))
        assert torch.allclose(out[:, :, 0].double(), want, atol=1e-5), step
    assert cur == {True, False}
    assert (max(kept) == 12) == (alpha == 5.0)


def test_authors_rows_below_the_cap_attend_every_token(model) -> None:
    c = _ctx(model, 64)
    s = InfiniGen(InfiniGenParams(budget_tokens=48, dense_layers=1), c)
    c.model = _Pred()
    g = torch.Generator().manual_seed(2)
    k = torch.randn(B, HKV, 40, D, generator=g)
    s.prefill(1, torch.randn(B, HQ, 40, D, generator=g), k, k)
    c.model.q = torch.randn(B, HQ, 1, D, generator=g)
    s.layer_input(0, torch.zeros(B, 1, SPEC.hidden))
    s.decode(1, c.model.q, k[:, :, :1], k[:, :, :1])
    assert bool(s.attended(1).all()) and s.queued is None


def test_bundled_calibration_text_is_not_the_default_scored_text() -> None:
    from kvbench.runtime.run import read_text

    text = calib.CALIB_TEXT.read_text()
    assert text[:400] not in read_text("")
    assert len(text) > 8000  # ~2.5K tokens: the first 2048 calibrate


TINY = ["--model", "smollm2-135m", "--weights", "random", "--layers", "2", "--prompt-len",
        "40", "--gen-len", "2"]


@pytest.mark.parametrize("args, words", [
    (["--variant", "nope"], "--variant 'nope': unknown (variants: authors, oracle)"),
    (["--skew-tokens", "8"], "--skew-tokens is not a parameter of variant 'authors'"),
    (["--variant", "oracle", "--calib-text", "x.txt"],
     "--calib-text is not a parameter of variant 'oracle'"),
])
def test_cli_refuses_bad_variants(args: list[str], words: str, capsys, tmp_path) -> None:
    out = tmp_path / "r.jsonl"
    assert_usage_error(cli(["run", "infinigen", *TINY, *args, "--out", str(out)], capsys), words)
    assert not out.exists()


def test_cli_refuses_scoring_the_calibration_text(capsys, tmp_path) -> None:
    """The same file as --text and --calib-text: refused after the (untimed) warm-up's
    prompt, before anything is measured or stored."""
    out, text = tmp_path / "r.jsonl", tmp_path / "t.txt"
    text.write_text(calib.CALIB_TEXT.read_text()[:400])
    assert_usage_error(cli(["run", "infinigen", *TINY, "--text", str(text), "--calib-text",
                            str(text), "--out", str(out)], capsys),
                       "scored text begins with the calibration text")
    assert not out.exists()
