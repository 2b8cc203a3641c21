"""`kvbench plan`: the CXL-PNM paper's Table 3 dollar figures, its batch of 96 for
Llama3.1-70B on 8 PNMs at 128K, capacity arithmetic by hand, and bad input; the GPU and
PNM counts of `kvbench project` (kvbench.hwmodel.profile.replicate)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import assert_usage_error, cli

from kvbench.cli import main
from kvbench.errors import KvbenchError
from kvbench.plan import PlanConfig, device_cost, plan

GiB = 1 << 30


def test_table_3_dollar_figures_exactly() -> None:
    """Table 3: operating 0.072 / 0.027 $/h, hardware 0.761 / 0.266 $/h (A100 / CXL-PNM)."""
    gpu = device_cost("a100-80gb", 0.181, 3)
    pnm = device_cost("cxl-pnm", 0.181, 3)
    assert (gpu["power_w"], pnm["power_w"]) == (400, 150)
    shown = [f"{x:.3f}" for x in (gpu["operating"], pnm["operating"], gpu["hardware"],
                                  pnm["hardware"])]
    assert shown == ["0.072", "0.027", "0.761", "0.266"]
    # Fig. 14's configurations (spec sheet, derived): 1 GPU + 8 PNM about $3.18/h
    assert f"{gpu['total'] + 8 * pnm['total']:.2f}" == "3.18"


def test_capacity_by_hand() -> None:
    """Llama3.1-8B: 128 KiB of FP16 KV per token (32 layers x 8 KV heads x 128 x 2 x 2)."""
    r = plan(PlanConfig(model="llama-3.1-8b", contexts="128K,1M", gpus=1, pnms=8,
                        budget_tokens=4096))
    assert r["kv_bytes_per_token"] == 32 * 8 * 128 * 2 * 2 == 128 << 10
    d128 = r["demand"][0]
    assert d128["kv"] == 131072 * (128 << 10) == 16 * GiB
    assert abs(d128["weights"] - 2 * 8.03e9) < 0.02e9  # published 8.03B parameters, FP16
    b128, b1m = r["max_batch"]
    free = 80 * GiB - d128["weights"]
    assert b128["gpu"] == int(free // (16 * GiB)) == 4
    assert b128["baseline"] == int(free // (4096 * (128 << 10)))
    assert b1m["pnm-kv"] == 8 * (512 // 128)  # 1M tokens = 128 GiB: 4 per 512 GiB PNM
    assert b1m["t_steady"] == int(4096 / 9)  # ratio #GPU / (#GPU + #PNM) = 1/9


def test_paper_batch_96_for_70b_on_8_pnms() -> None:
    """Section 4.2: 2GPU+8PNM on Llama3.1-70B at 128K lifts the batch "from 1 to 96"."""
    r = plan(PlanConfig(model="llama-3.1-70b", contexts="128K", gpus=2, pnms=8))
    assert r["max_batch"][0]["pnm-kv"] == 96
    assert r["max_batch"][0]["gpu"] == 0  # the full KV does not fit beside the weights


def test_cli_json_and_bad_input(capsys, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "llama-3.1-405b", "--gpus", "16", "--pnms", "4",
              "--contexts", "1M", "--json", "--out", str(out)])
    assert e.value.code == 0
    r = json.loads(out.read_text())
    assert r["provenance"] == "projected" and r["max_batch"][0]["context"] == 1 << 20
    capsys.readouterr()
    for args, message in ((["--gpus", "0"], "--gpus must be at least 1"),
                          (["--model", "gpt-9"], "unknown model 'gpt-9'"),
                          (["--steady-ratio", "2"], "--steady-ratio 2.0: must be in [0, 1]"),
                          (["--contexts", "12Q"], "12Q")):
        assert_usage_error(cli(["plan", *args], capsys), message)


def test_project_replicates_gpus_and_pnms() -> None:
    """2 GPUs + 8 PNMs: rates, power and price times the counts; a PNM-bound step takes an
    eighth of one PNM's time; 0 PNMs drops the device (the GPU-CXL-memory baseline)."""
    from kvbench.hwmodel.profile import load, replicate
    from kvbench.hwmodel.schedule import Timer
    from kvbench.runtime.trace import Task

    one = load("a100-pnm")
    p = replicate(one, 2, 8)
    assert p.get("accel", "memory_gbps") == 4000 and p.tflops("float16") == 624
    assert p.get("pnm", "memory_gbps") == 8800 and p.get("power", "pnm_peak_w") == 1200
    assert p.get("price", "usd_per_hour") + p.get("price", "pnm_usd_per_hour") == \
        pytest.approx(2 * 0.833 + 8 * 0.293)
    assert p.get("h2d", "pinned") == {"peak_gbps": 50.0, "latency_us": 10.0}  # a link per GPU
    t = Task(0, 1, 0, "pnm", "attention", {"bytes_read": 1.1e12})
    assert Timer(one, "float16", "pinned").seconds(t) == pytest.approx(1.0)
    assert Timer(p, "float16", "pinned").seconds(t) == pytest.approx(1 / 8)
    base = replicate(one, 4, 0)
    assert "pnm" not in base.tables and "pnm_peak_w" not in base.tables["power"]
    assert base.tables["replicas"] == {**base.tables["replicas"], "gpus": 4, "pnms": 0}
    with pytest.raises(KvbenchError, match="at least 1 GPU"):
        replicate(one, 0, 1)


def test_project_cli_gpu_and_pnm_counts(tmp_path: Path, capsys) -> None:
    """`kvbench project --gpus/--pnms` on a pnm-kv trace: the counts in every record's
    params, more PNMs a faster projected step at the paper's 8B shape, `--skip-steps` the
    warm-up left out, bad counts exit 2."""
    from kvbench.store import load

    src, outs = tmp_path / "src.jsonl", {}
    with pytest.raises(SystemExit) as e:
        main(["run", "pnm-kv", "--weights", "random", "--layers", "3", "--prompt-len", "64",
              "--gen-len", "2", "--budget-tokens", "32", "--page-size", "8", "--threads", "1",
              "--out", str(src)])
    assert e.value.code == 0
    for n in (1, 8):
        outs[n] = tmp_path / f"p{n}.jsonl"
        with pytest.raises(SystemExit) as e:
            main(["project", str(src), "--hardware", "a100-pnm", "--gpus", "1", "--pnms",
                  str(n), "--model", "llama-3.1-8b", "--batch", "64", "--prompt-len",
                  "131072", "--gen-len", "3", "--bookkeeping", "none", "--skip-steps", "1",
                  "--out", str(outs[n])])
        assert e.value.code == 0
    tbt = {}
    for n, path in outs.items():
        recs = [r for r in load(path).records if r.get("kind") == "run"]
        assert {(r["params"]["gpus"], r["params"]["pnms"], r["provenance"]) for r in recs} \
            == {(1, n, "projected")}
        tbt[n] = next(r for r in recs if r["metric"] == "tbt")
        assert len(tbt[n]["samples"]) == 2 and tbt[n]["method"]["skipped_steps"] == 1
    assert tbt[8]["value"] < tbt[1]["value"] / 2  # the device's KV reads dominate at 128K
    capsys.readouterr()
    assert_usage_error(cli(["project", str(src), "--hardware", "a100-pnm", "--gpus", "0"],
                           capsys), "at least 1 GPU")
