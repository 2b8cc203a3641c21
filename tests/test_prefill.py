"""Shared prefill (kvbench.runtime.prefill): a prefill recorded by one strategy and replayed
into every registered strategy leaves it in the state its own prefill leaves, and a file
that does not match the run is refused with one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import assert_usage_error, cli, needs_bundled

from kvbench.runtime import prefill
from kvbench.runtime.context import Counters, RunContext
from kvbench.runtime.run import decode_run, read_text, token_rows
from kvbench.strategies import STRATEGIES

P, G = 88, 12  # as the contract test: decode crosses page boundaries


def _run(bundled, name: str, record: prefill.Recorder | None = None,
         replay: prefill.Replay | None = None) -> tuple[list[float], dict]:
    """Eval-mode NLL of every scored token of `name` at its `sparse` setting (where its
    decisions depend on what its prefill kept) and the prefill's counted work."""
    spec, model = bundled.model.spec, bundled.model
    length = P + G + 1
    rows = token_rows(bundled.encode(read_text("")), 1, length, spec.vocab)
    cpu = torch.device("cpu")
    cls = STRATEGIES.get(name)
    counters = Counters(spec.n_kv_heads, 4, metrics=cls.metrics)
    ctx = RunContext(spec, spec.n_layers, 1, length, torch.float32, cpu, cpu, counters, model)
    params = dataclasses.replace(cls.params(), **dict(cls.sparse or ()))
    params, _ = cls.for_run(params, length)
    strategy = cls(params, ctx)
    model.setup(strategy, counters, length)
    model.recorder = record
    try:
        out = decode_run(model, strategy, rows, G, "eval", lambda: None, replay=replay)
    finally:
        model.recorder = None
    work = {(quantity, where, layer): steps.get(0)
            for quantity, where, layer, steps in counters.series()
            if counters.unit(quantity) != "s"}
    return out.nll, work


@pytest.fixture(scope="module")
def recorded(bundled, tmp_path_factory) -> prefill.Replay:
    """full attention's prefill of the eval prompt, recorded and loaded back."""
    rec = prefill.Recorder()
    _run(bundled, "full", record=rec)
    spec = bundled.model.spec
    rows = token_rows(bundled.encode(read_text("")), 1, P + G + 1, spec.vocab)[:, :P]
    meta = {"model": spec.name, "weights": "bundled", "layers": spec.n_layers, "seed": None,
            "dtype": "float32", "accel": "cpu", "batch": 1, "prompt_len": P}
    path = tmp_path_factory.mktemp("prefill") / "p.pt"
    rec.save(path, meta, rows, "test")
    assert len(rec.layers) == spec.n_layers and rec.logits.shape == (1, spec.vocab)
    return prefill.load(path, meta, rows, torch.device("cpu"))


@pytest.mark.parametrize("name", STRATEGIES.names())
def test_replay_equals_own_prefill(name: str, bundled, recorded) -> None:
    """Every registered strategy, at its small-budget setting, scores every token the same
    after full's recorded prefill as after its own (its caches, digests, scores and first
    selection built from the replayed tensors), and counts the same prefill work."""
    own, own_work = _run(bundled, name)
    shared, shared_work = _run(bundled, name, replay=recorded)
    assert len(shared) == len(own) == G + 1
    assert max(abs(a - b) for a, b in zip(own, shared, strict=True)) < 1e-5, name
    assert shared_work == own_work


def test_replay_answers_prompt_attention_from_the_file(bundled, recorded, monkeypatch) -> None:
    """The replay does not recompute the prompt's attention: with the kernels' compute
    paths broken for prompts, a replayed prefill still runs (and an own one does not)."""
    from kvbench.kernels import attention

    real = attention.torch_attention

    def no_prompts(q, k, v, *args):
        assert q.shape[2] == 1, "prompt attention recomputed"
        return real(q, k, v, *args)

    monkeypatch.setattr(attention, "torch_attention", no_prompts)
    nll, _ = _run(bundled, "quest", replay=recorded)
    assert len(nll) == G + 1
    with pytest.raises(AssertionError, match="prompt attention recomputed"):
        _run(bundled, "quest")


def _records(path: Path) -> list[dict]:
    return [r for line in path.read_text().splitlines()
            if (r := json.loads(line))["kind"] == "run"]


ARGS = ["--weights", "random", "--layers", "2", "--prompt-len", "40", "--gen-len", "2",
        "--threads", "1"]


@needs_bundled
def test_cli_records_then_replays(tmp_path: Path, capsys) -> None:
    """`--prefill DIR`: the first run records its prefill into DIR, the next replays it;
    its records say so, waive ttft and keep the own run's parameters (compare pairs them)."""
    d = tmp_path / "pf"
    d.mkdir()
    assert cli(["run", "full", *ARGS, "--prefill", str(d), "--out", str(tmp_path / "a.jsonl")],
               capsys).returncode == 0
    (made,) = list(d.glob("prefill-*.pt"))
    assert cli(["run", "streaming", *ARGS, "--gpu-tokens", "16", "--prefill", str(d),
                "--out", str(tmp_path / "b.jsonl")], capsys).returncode == 0
    own, shared = _records(tmp_path / "a.jsonl"), _records(tmp_path / "b.jsonl")
    assert all(r["method"]["prefill"].startswith("own, recorded to") for r in own)
    assert all(r["method"]["prefill"].startswith(f"shared: replayed from {made}")
               for r in shared)
    assert "kvbench run full" in shared[0]["method"]["prefill"]
    ttft = {r["name"]: r for r in own + shared if r["metric"] == "ttft"}
    assert ttft["full"]["status"] == "ok" and ttft["streaming"]["status"] == "waived"
    peak = {(r["name"], r["params"]["where"]): r["status"] for r in own + shared
            if r["metric"] == "peak_memory"}
    assert peak[("full", "host")] == "ok" and peak[("streaming", "host")] == "waived"
    tbt = next(r for r in shared if r["metric"] == "tbt")
    assert tbt["status"] == "ok" and "prefill" not in tbt["params"]


@needs_bundled
def test_mismatch_and_corrupt_files_are_refused(tmp_path: Path, capsys) -> None:
    """A file recorded for another batch, prompt or seed is refused naming the field; a
    corrupt one is refused as unreadable; multi-turn runs cannot share a prefill."""
    f = tmp_path / "p.pt"
    assert cli(["run", "full", *ARGS, "--prefill", str(f), "--out", str(tmp_path / "a.jsonl")],
               capsys).returncode == 0
    assert f.exists()
    assert_usage_error(cli(["run", "quest", *ARGS, "--batch", "2", "--prefill", str(f)],
                           capsys), "recorded with batch 1, this run has 2")
    assert_usage_error(cli(["run", "quest", *ARGS, "--seed", "3", "--prefill", str(f)],
                           capsys), "recorded with seed 0, this run has 3")
    assert_usage_error(cli(["run", "quest", *ARGS, "--text", "/usr/share/common-licenses/GPL-3",
                            "--prefill", str(f)], capsys), "other prompt tokens")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a prefill")
    assert_usage_error(cli(["run", "quest", *ARGS, "--prefill", str(bad)], capsys),
                       "unreadable")
    assert_usage_error(cli(["run", "full", *ARGS, "--turns", "2", "--prefill", str(f)],
                           capsys), "single-turn")


@pytest.mark.parametrize(("t", "n", "chunk"), [(40, 40, 16), (40, 40, 512), (7, 47, 3),
                                               (5, 30, 4)])
def test_column_scores_equal_the_softmax_columns(t: int, n: int, chunk: int) -> None:
    """What H2O and HGCA keep from a prefill (replayed or their own): the causal attention
    mass per key, equal to softmax rows summed in float64, for a prefill (t == n), an
    append after n - t cached keys, and keys that all precede the queries (q_start = n)."""
    from kvbench.kernels.attention import dense_attention
    from kvbench.strategies import column_scores

    g = torch.Generator().manual_seed(t + n)
    q, k = torch.randn(2, 6, t, 8, generator=g), torch.randn(2, 2, n, 8, generator=g)
    for start in (n - t, n):
        _, lse = dense_attention(q, k, k, q_start=start, backend="torch")
        got = column_scores(q, k, lse, q_start=start, chunk=chunk)
        logits = q.double() @ k.double().repeat_interleave(3, 1).transpose(-1, -2) * 8 ** -0.5
        pos = torch.arange(start, start + t)[:, None]
        logits.masked_fill_(torch.arange(n)[None, :] > pos, float("-inf"))
        want = torch.softmax(logits, dim=-1).sum(dim=2)
        assert torch.allclose(got.double(), want, atol=1e-5), (start, (got - want).abs().max())
