"""Negative controls (kvbench.present.control): a control run faster than its reference
beyond the two runs' noise fails, within it passes, repetitions pool, and `kvbench
experiment render` exits 1 on a failed control while still writing the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import cli

from kvbench.errors import KvbenchError
from kvbench.present.control import Control, verdicts


def tbt(name: str, samples: list[float], unit: str = "", **params: object) -> dict:
    return {"schema_version": 1, "kind": "run", "name": name, "reason": "", "metric": "tbt",
            "unit": "s", "direction": "lower",
            "value": sorted(samples)[len(samples) // 2], "samples": samples, "status": "ok",
            "provenance": "measured", "params": {"batch": 1, **params},
            "method": {"suite_case": unit} if unit else {}}


CONTROL = Control("covering budget", {"name": "quest"}, {"name": "full"}, ("prompt_len",))


def test_gain_beyond_the_noise_fails_and_within_it_passes() -> None:
    recs = [tbt("full", [1.0, 1.0, 1.01], prompt_len=8), tbt("full", [2.0] * 3, prompt_len=16),
            tbt("quest", [0.7, 0.7, 0.7], prompt_len=8, budget_tokens=16),   # 43% faster
            tbt("quest", [1.95, 1.96, 1.97], prompt_len=16, budget_tokens=32)]  # 2%: noise
    got = {v.run: v for v in verdicts(CONTROL, recs, {})}
    fast = got["name quest, budget_share 2x, prompt_len 8"]
    same = got["name quest, budget_share 2x, prompt_len 16"]
    assert fast.gain == pytest.approx(1 / 0.7 - 1) and not fast.ok
    assert fast.noise == pytest.approx(0.10)  # tight runs: the tolerance
    assert same.ok and same.gain == pytest.approx(2.0 / 1.96 - 1)


def test_a_wide_spread_allows_more_and_repetitions_pool() -> None:
    """Spread: each run's (p90 - p10) / median added; a case's repetitions (units) are one
    run with their samples together, not two references."""
    recs = [tbt("full", [1.0, 1.0], "a", prompt_len=8), tbt("full", [1.6, 1.6], "b", prompt_len=8),
            tbt("quest", [1.0, 1.2, 1.4], "c", prompt_len=8)]
    (v,) = verdicts(CONTROL, recs, {})
    assert v.reference.n == 4 and v.control.n == 3
    assert v.noise > 0.3 and v.ok


def test_bound_allows_what_the_counted_bytes_allow() -> None:
    """bound = true: a control may gain its bytes' share (full reads 1.25x its bytes: 25%)
    plus the noise; past that it fails, and without step_bytes it is refused."""
    def nbytes(name: str, value: float, **params: object) -> dict:
        return {**tbt(name, [value], **params), "metric": "step_bytes",
                "params": {"batch": 1, **params, "where": "total"}}

    bound = Control("short context", {"name": "quest"}, {"name": "full"}, ("prompt_len",),
                    bound=True)
    recs = [tbt("full", [1.0] * 3, prompt_len=8), tbt("quest", [0.75] * 3, prompt_len=8),
            nbytes("full", 125.0, prompt_len=8), nbytes("quest", 100.0, prompt_len=8)]
    (v,) = verdicts(bound, recs, {})
    assert v.bytes_gain == pytest.approx(0.25) and v.allowed == pytest.approx(0.35) and v.ok
    recs[1] = tbt("quest", [0.7] * 3, prompt_len=8)  # 43% faster: past 25% + 10%
    assert not verdicts(bound, recs, {})[0].ok
    assert verdicts(CONTROL, recs, {})[0].bytes_gain == 0  # bound off: bytes ignored
    with pytest.raises(KvbenchError, match="bound = true needs it"):
        verdicts(bound, recs[:3], {})


def test_a_control_without_its_reference_is_refused() -> None:
    with pytest.raises(KvbenchError, match="0 reference runs"):
        verdicts(CONTROL, [tbt("full", [1.0], prompt_len=8),
                           tbt("quest", [1.0], prompt_len=16)], {})
    with pytest.raises(KvbenchError, match="no tbt records match"):
        verdicts(CONTROL, [tbt("full", [1.0], prompt_len=8)], {})


def test_render_exits_1_on_a_failed_control(tmp_path: Path, capsys, monkeypatch) -> None:
    records = tmp_path / "r.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in [
        tbt("full", [1.0, 1.0, 1.0], prompt_len=8), tbt("quest", [0.5] * 3, prompt_len=8,
                                                        budget_tokens=16)]))
    path = tmp_path / "e.toml"
    path.write_text(f'[experiment]\nname = "e"\nrecords = ["{records}"]\n'
                    '[[table]]\ntitle = "t"\nmetric = "tbt"\nrows = "name"\ncolumns = "batch"\n'
                    '[[control]]\ntitle = "covering budget"\nwhere = { name = "quest" }\n'
                    'reference = { name = "full" }\nmatch = ["prompt_len"]\n')
    from kvbench.experiment_spec import load_experiment

    monkeypatch.setattr("kvbench.experiment_spec.Experiment.out", property(lambda e: tmp_path))
    assert load_experiment(path).controls[0].match == ("prompt_len",)
    result = cli(["experiment", "render", str(path)], capsys)
    assert result.returncode == 1
    assert "negative control failed: covering budget: name quest, budget_share 2x, prompt_len " \
        "8 +100.0%" in result.stdout
    table = (tmp_path / "table.md").read_text()
    assert "## Negative controls" in table and "FAIL" in table
