"""The run: perplexity against transformers on the bundled model, records, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_usage_error, cli, needs_bundled

from kvbench.cli import main
from kvbench.runtime.run import RunConfig, read_text, token_rows


def test_perplexity_matches_transformers(bundled) -> None:
    """Full attention, eval mode through the decode path: perplexity of tokens P..P+G
    equals transformers' on the same tokens within 0.1% relative (issue bar)."""
    import math

    import torch
    import torch.nn.functional as F

    from kvbench.runtime.context import Counters, RunContext
    from kvbench.runtime.run import decode_run
    from kvbench.strategies import STRATEGIES

    p, g = 64, 48
    spec, model = bundled.model.spec, bundled.model
    rows = token_rows(bundled.encode(read_text("")), 1, p + g + 1, spec.vocab)
    cpu = torch.device("cpu")
    counters = Counters(spec.n_kv_heads, 4)
    ctx = RunContext(spec, 30, 1, p + g + 1, torch.float32, cpu, cpu, counters, model)
    strategy = STRATEGIES.get("full")(None, ctx)
    model.setup(strategy, counters, p + g + 1)
    out = decode_run(model, strategy, rows, g, "eval", lambda: None)
    assert len(out.nll) == g + 1
    ours = math.exp(sum(out.nll) / len(out.nll))
    with torch.no_grad():
        logits = bundled.hf_model(rows[:, :-1]).logits[:, p - 1:].float()
    ref = math.exp(F.cross_entropy(logits.reshape(-1, spec.vocab), rows[:, p:].reshape(-1)))
    assert 1.5 < ref < 100  # a real model on English text, not a random one
    assert abs(ours / ref - 1) < 1e-3
    # the work trace counted every layer of every step
    assert counters.step_total("tokens", "accel", g) == (p + g) * 30


def test_token_rows_windows_and_short_text() -> None:
    rows = token_rows(list(range(100)), 3, 40, 1000)
    assert rows.shape == (3, 40)
    assert rows[:, 0].tolist() == [0, 30, 60]
    from kvbench.errors import KvbenchError

    with pytest.raises(KvbenchError, match="longer than the text"):
        token_rows(list(range(10)), 1, 11, 1000)


def _records(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "run"]


def test_random_run_writes_labelled_records(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["run", "full", "--model", "opt-125m", "--weights", "random", "--layers", "2",
              "--prompt-len", "24", "--gen-len", "6", "--batch", "2", "--mode", "eval",
              "--out", str(out)])
    assert e.value.code == 0
    recs = _records(out)
    by = {r["metric"]: r for r in recs if not r["metric"].startswith("trace.")}
    assert by["tbt"]["stats"]["n"] == 6 and by["tbt"]["value"] > 0
    assert by["perplexity"]["status"] == "waived" and "random" in by["perplexity"]["reason"]
    assert all(r["params"]["layers"] == 2 and r["params"]["layers_total"] == 12 for r in recs)
    tok = [r for r in recs if r["metric"] == "trace.tokens" and r["params"]["phase"] == "decode"
           and r["params"]["layer"] == 1]
    # batch 2, step s attends to the prompt plus s tokens
    assert tok[0]["samples"] == [2.0 * (24 + s) for s in range(1, 7)]
    # full attention allocates k and v [2, 12 heads, 31 tokens, 64] float32 in 2 layers
    alloc = {r["params"]["where"]: r["value"] for r in recs if r["metric"] == "kv_alloc_bytes"}
    assert alloc == {"accel": 2 * 2 * 2 * 12 * 31 * 64 * 4, "host": 0}


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt-5"], "unknown model"),
    (["--model", "opt-125m", "--weights", "/nonexistent"], "not 'bundled', 'random' or"),
    (["--model", "opt-125m", "--weights", "bundled"], "bundled weights exist only"),
    (["--model", "opt-125m", "--weights", "random", "--prompt-len", "2040"],
     "exceeds opt-125m's context"),
    (["--model", "llama-3.1-405b", "--weights", "random", "--batch", "64",
      "--prompt-len", "100000"], "does not fit"),
    (["--mode", "train"], "--mode"),
    (["--turns", "0"], "--turns must be at least 1"),
    (["--model", "opt-125m", "--weights", "random", "--prompt-len", "200", "--turns", "10"],
     "x 10 turns exceeds opt-125m's context"),
    (["--turns", "2", "--compare-hf"], "--compare-hf times single-turn generation"),
])
def test_bad_input_exits_2(args: list[str], message: str, capsys) -> None:
    assert_usage_error(cli(["run", "full", *args], capsys), message)


def test_random_weights_of_a_rotary_model_go_past_its_context() -> None:
    """Speed runs of random weights take any length RoPE can place, and say so; the bundled
    checkpoint and learned positions (opt) stop at the trained context."""
    from kvbench.errors import KvbenchError
    from kvbench.models import get_spec
    from kvbench.runtime.run import RunConfig, past_context, resolve

    long = RunConfig(weights="random", prompt_len=9000, gen_len=4)
    assert resolve(long)[4] == "random"
    assert "9005 tokens, past smollm2-135m's trained context of 8192" in past_context(
        long, get_spec("smollm2-135m"))
    assert past_context(RunConfig(prompt_len=8000), get_spec("smollm2-135m")) == ""
    with pytest.raises(KvbenchError, match="random weights, for speed only, may go past it"):
        resolve(RunConfig(prompt_len=9000))


def test_prompt_longer_than_text_exits_2(tmp_path: Path, capsys) -> None:
    text = tmp_path / "short.txt"
    text.write_text("a short text")
    assert_usage_error(cli(["run", "full", "--model", "opt-125m", "--weights", "random",
                            "--layers", "1", "--text", str(text), "--prompt-len", "64", "--out",
                            str(tmp_path / "x.jsonl")], capsys),
                       f"longer than --text '{text}' (12 tokens)")
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize("content, message", [
    (b"\x7fELF\x02\x01\x01\x00\xff\xfe binary", "is not UTF-8 text (byte 8"),
    (None, "is not a readable file"),
])
def test_text_that_is_not_utf8_is_refused_by_name(content: bytes | None, message: str,
                                                   tmp_path: Path, capsys) -> None:
    """A binary --text (e.g. /bin/ls) used to be decoded with replacement characters and
    run; a folder as --text is refused the same way."""
    text = tmp_path / "t.bin"
    if content is None:
        text.mkdir()
    else:
        text.write_bytes(content)
    out = tmp_path / "x.jsonl"
    assert_usage_error(cli(["run", "full", "--weights", "random", "--layers", "1", "--mode",
                            "eval", "--text", str(text), "--prompt-len", "8", "--gen-len", "2",
                            "--out", str(out)], capsys), f"--text '{text}' {message}")
    assert not out.exists()


def test_cuda_without_gpu_exits_2(capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert_usage_error(cli(["run", "full", "--device", "cuda"], capsys), "no CUDA GPU")


def test_run_config_defaults_match_cli() -> None:
    """Suites build RunConfig from TOML by field name: every field is a CLI option."""
    from dataclasses import fields

    import typer.main

    from kvbench.runtime.command import make_command
    from kvbench.strategies import STRATEGIES

    cmd = typer.main.get_command_from_info(
        typer.models.CommandInfo(callback=make_command(STRATEGIES.get("full"))),
        pretty_exceptions_short=True, rich_markup_mode=None)
    names = {p.name: p.default for p in cmd.params}
    for f in fields(RunConfig):
        assert names[f.name] == f.default


@pytest.mark.gpu
@needs_bundled
def test_gpu_run_and_hf_comparison(tmp_path: Path) -> None:
    """On a GPU: full attention at batch 8 on the bundled model next to transformers, and
    the accelerator's allocator peak recorded (not run on the CPU-only development box)."""
    out = tmp_path / "gpu.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["run", "full", "--device", "cuda", "--batch", "8", "--prompt-len", "128",
              "--gen-len", "16", "--compare-hf", "--out", str(out)])
    assert e.value.code == 0
    by = {(r["metric"], r["params"].get("where")): r for r in _records(out)}
    assert by[("peak_memory", "accel")]["value"] > 0
    assert by[("decode_speed_vs_hf", None)]["value"] > 0
    assert all(r["params"]["accel"] == "cuda" for r in by.values())


@pytest.mark.gpu
@needs_bundled
def test_cuda_greedy_tokens_equal_transformers_generate() -> None:
    """On CUDA, float32, batch 2: the tokens kvbench's full attention decodes greedily from
    the bundled model (the prefill's and 16 decode steps') are transformers' greedy
    `generate` on the same prompt, token for token; and `--compare-hf`'s record of the run
    (kvbench.runtime.engine.compare_hf) reports that agreement as 1.0."""
    import torch

    from kvbench.models import get_spec
    from kvbench.models.weights import load
    from kvbench.runtime.context import Counters, RunContext
    from kvbench.runtime.engine import compare_hf
    from kvbench.runtime.run import decode_run
    from kvbench.strategies import STRATEGIES

    cuda, spec = torch.device("cuda"), get_spec("smollm2-135m")
    loaded = load(spec, "bundled", spec.n_layers, torch.float32, cuda)
    b, p, g = 2, 64, 16
    prompt = token_rows(loaded.encode(read_text("")), b, p, spec.vocab).to(cuda)
    counters = Counters(spec.n_kv_heads, 4)
    ctx = RunContext(spec, spec.n_layers, b, p + g + 1, torch.float32, cuda,
                     torch.device("cpu"), counters, loaded.model)
    strategy = STRATEGIES.get("full")(None, ctx)
    loaded.model.setup(strategy, counters, p + g + 1)
    ours = decode_run(loaded.model, strategy, prompt, g, "generate", torch.cuda.synchronize)
    hf = loaded.hf_model.to(cuda)
    with torch.no_grad():
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=g + 1, min_new_tokens=g + 1, pad_token_id=0)
    assert theirs.shape == (b, p + g + 1)
    assert torch.equal(ours.tokens[:, :p + g + 1].cpu(), theirs.cpu())
    _, ratio = compare_hf("full", {"mode": "generate"}, hf, prompt, ours, lambda: [], cuda,
                          torch.cuda.synchronize, rounds=1)
    assert ratio.method["greedy_token_agreement"] == 1.0
