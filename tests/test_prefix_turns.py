"""A multi-turn run with a prefix cache: export/import of full and hgca, each later turn's
request timed as recompute / load / resident with logits checked (bitwise against the
resident KV, fp tolerance against recompute), the run's records, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_usage_error, cli

from kvbench.models import ModelSpec
from kvbench.prefix.cache import PrefixCache
from kvbench.prefix.tiers import TierSpec
from kvbench.prefix.turns import PATHS, PrefixTurns
from kvbench.runtime.context import Counters, RunContext
from kvbench.runtime.run import decode_run
from kvbench.strategies import STRATEGIES, NoParams, supports_prefix
from kvbench.strategies.hgca import HgcaParams
from kvbench.topology import libnuma

SPEC = ModelSpec("tiny-gqa", "llama", 2, 4, 2, 64, 128, 100, 256, head_dim=16)
CPU = torch.device("cpu")
META = {"model": SPEC.name, "layers": 2, "dtype": "float32", "kv_heads": 2, "head_dim": 16}


@pytest.fixture(scope="module")
def model():
    """Random tiny decoder, weights scaled to std 0.15 (sharp attention: errors show)."""
    from kvbench.models.weights import load

    m = load(SPEC, "random", 2, torch.float32, CPU, seed=1).model
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.mul_(7.5)
    return m


def conversation(model, name: str, params, spec: TierSpec, chunk: int, p: int = 12,
                 g: int = 4, turns: int = 3) -> PrefixTurns:
    """A 3-turn eval run of strategy `name` with the prefix-cache hook; its results."""
    max_len = turns * (p + g + 1)
    cls = STRATEGIES.get(name)

    def fresh():
        ctx = RunContext(SPEC, 2, 2, max_len, torch.float32, CPU, CPU, Counters(2, 4), model)
        s = cls(params, ctx)
        model.setup(s, ctx.counters, max_len)
        return s

    main_s = fresh()
    cache = PrefixCache(spec, 1 << 22, chunk, META, CPU)
    hook = PrefixTurns(cache, model, fresh,
                       lambda: model.setup(main_s, main_s.ctx.counters, max_len),
                       lambda: None, 2, p, g)
    rows = torch.randint(0, 100, (2, max_len), generator=torch.Generator().manual_seed(0))
    decode_run(model, main_s, rows, g, "eval", lambda: None, turns=turns, between=hook.between)
    return hook


def test_full_and_hgca_export_and_import() -> None:
    assert supports_prefix(STRATEGIES.get("full")) and supports_prefix(STRATEGIES.get("hgca"))
    assert not supports_prefix(STRATEGIES.get("h2o"))


@pytest.mark.parametrize("name, params", [
    ("full", NoParams()),
    ("hgca", HgcaParams(gpu_tokens=8, block=4, beta=0.0)),  # ring of 2 blocks, exact
])
def test_loaded_kv_gives_recompute_logits(model, tmp_path: Path, name, params) -> None:
    """Every tier: turn k's request loads the previous turn's whole chunks (17k - 1 tokens
    were cached: chunk 1 loads all of them, chunk 4 the whole chunks), the load path's
    logits are bitwise those of the same KV resident on the accelerator and within fp
    tolerance of recomputing the request."""
    specs = [TierSpec("accel"), TierSpec("disk", path=str(tmp_path))]
    if libnuma() is not None:
        specs.append(TierSpec("host", node=0))
    for spec in specs:
        for chunk in (1, 4):
            hook = conversation(model, name, params, spec, chunk)
            assert [r.turn for r in hook.results] == [1, 2]
            for r in hook.results:
                cached = r.turn * 17 - 1
                assert r.hit == cached // chunk * chunk and r.request == r.turn * 17 + 12
                assert r.bitwise, (spec, chunk, r.turn)
                assert r.max_diff < 1e-3 and r.argmax_agree == 1.0
                assert r.bytes_loaded == 2 * r.hit * 2 * 2 * 2 * 16 * 4
                assert all(len(r.times[path][0]) == 2 for path in PATHS)
            for f in tmp_path.glob("*.kvc"):
                f.unlink()


def test_hgca_sparse_kv_differs_from_recompute(model) -> None:
    """The check above can fail: hgca at beta 1 saved KV computed through sparse decode
    steps, so its loaded request still equals the resident one bitwise but not recompute."""
    hook = conversation(model, "hgca", HgcaParams(gpu_tokens=8, block=4, beta=1.0),
                        TierSpec("accel"), 1)
    assert all(r.bitwise for r in hook.results)
    assert max(r.max_diff for r in hook.results) > 1e-3


BASE = ["--model", "opt-125m", "--weights", "random", "--layers", "2", "--prompt-len", "12",
        "--gen-len", "3"]


def test_cli_run_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.jsonl"
    assert cli(["run", "full", *BASE, "--turns", "3", "--prefix-cache",
                f"disk:{tmp_path / 'c'}", "--prefix-chunk", "4", "--prefix-reps", "2",
                "--out", str(out)], capsys).returncode == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    ttft = [r for r in recs if r.get("metric") == "prefix_ttft"]
    assert sorted((r["params"]["turn"], r["params"]["path"]) for r in ttft) == sorted(
        (t, p) for t in (1, 2) for p in PATHS)
    assert all(r["stats"]["n"] == 2 and r["params"]["prefix_cache"].startswith("disk:")
               for r in ttft)
    diff = [r for r in recs if r.get("metric") == "prefix_logits_max_abs_diff"]
    assert all(r["method"]["bitwise_equal_resident"] for r in diff)
    hits = next(r for r in recs if r.get("metric") == "prefix_hits")
    # 15 then 31 tokens cached: 3 then 7 chunks hit, by the warm-up and 2 timed loads
    assert hits["value"] == 3 * (3 + 7) and hits["method"]["tier"].startswith("disk:")


@pytest.mark.parametrize("args, msg", [
    (["--turns", "2", "--prefix-cache", "host:9"], "NUMA node 9 does not exist"),
    (["--turns", "2", "--prefix-cache", "disk:/proc/kvbench-cache"], "disk:/proc"),
    (["--turns", "2", "--prefix-cache", "accel", "--prefix-capacity", "1K", "--prefix-chunk",
      "4"], "--prefix-capacity 1K (1 KiB) is smaller than one turn's KV: batch 1 x 12 tokens "
     "x 12288 B/token = 144 KiB"),
    (["--turns", "1", "--prefix-cache", "accel"], "pass --turns 2 or more"),
    (["--turns", "2", "--prefix-cache", "gpu"], "accel, host:N"),
])
def test_cli_bad_input_exit_2(args, msg, capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(cli(["run", "full", *BASE, *args], capsys), msg)


def test_cli_refuses_strategy_without_export(capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(cli(["run", "h2o", *BASE, "--turns", "2", "--prefix-cache", "accel"],
                           capsys), "'h2o' does not export")


def test_cli_refuses_corrupt_cache_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    (tmp_path / "x.kvc").write_bytes(b"garbage")
    assert_usage_error(cli(["run", "full", *BASE, "--turns", "2", "--prefix-cache",
                            f"disk:{tmp_path}"], capsys), "not a kvbench prefix cache file")
